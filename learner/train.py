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

What is not the loop lives beside it, by concern: ``resume`` (--resume, --like, a checkpoint restored),
``checkpointing`` (what a checkpoint holds, when one is written, best.pt), ``records`` (metrics.jsonl,
TensorBoard, W&B, the progress bar or lines, summary.json, returns.png), ``fleetwatch`` (fault counts, slow
replicas), ``progress`` (the bar, Ctrl-C), ``device`` and ``provenance`` (config.json's versions and machine).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

try:
    import torch
except ModuleNotFoundError as _err:  # (`from learner.train import train` in a script: say how to install it)
    if _err.name != "torch":  # (a broken install: a module torch needs is missing, named as it is)
        raise
    from learner.errors import install_hint

    raise ModuleNotFoundError(
        f"learner.train needs torch, which is not installed here: {install_hint('torch')}", name="torch"
    ) from _err
from torch import Tensor, optim

from env_server.isolation import env_returned
from env_server.ratelimit import LogBudget
from learner import rundir
from learner.capture import VideoCapture, check_videos_folder, listed_videos
from learner.checkpoint import (
    capture_rng,
    find_checkpoint,
    load_checkpoint,
    load_latest_readable,
    restore_rng,
    save_best_checkpoint,
    save_checkpoint,
)
from learner.checkpointing import Checkpointer
from learner.config import Args, PPOConfig, default_run_dir, resolve_ppo
from learner.device import available_memory, device_hint, machine_busy, pick_device, set_torch_threads
from learner.envs import FleetSpec, env_server_of, fleet_spec, open_fleet, raw_atari_frames, reward_threshold, server_of
from learner.errors import (
    EnvCrashedError,
    EnvFleetError,
    InvalidResponseError,
    OptionError,
    RemoteEnvError,
    RemoteTimeoutError,
    ServerUnavailableError,
    SessionError,
    TrainingInterrupted,
    UnusableEnvOutputError,
    os_reason,
)
from learner.faults import misfit_reported
from learner.fleet import FleetChange, carry_over
from learner.fleetwatch import FAULT_COUNTS, FleetWatch, every_replica, replica_metrics_note
from learner.live_metrics import LearnerMetrics, serve_metrics
from learner.local import label_of
from learner.normalize import DictRunningMeanStd, RewardScaler, RunningMeanStd, obs_normalizer
from learner.periodic_eval import PeriodicEval, eval_fleet, open_eval_envs
from learner.ppo import (
    Agent,
    Obs,
    RawObs,
    check_trainable,
    image_keys,
    in_bounds,
    is_image_space,
    obs_map,
    obs_put,
    observations_usable,
    raise_overflowed_return,
    raise_unusable,
    raise_unusable_rewards,
    vector_keys,
)
from learner.progress import StopRequest, bar_by_default, close_bar, progress_bar
from learner.provenance import machine_info, run_versions
from learner.records import (
    EventsWriter,
    Recorder,
    build_summary,
    fault_tags_started,
    hyperparameters_text,
    mean_or_none,
    plot_at_exit,
)
from learner.resume import (
    RECENT,
    Counters,
    check_resume,
    earlier_sessions,
    from_other_versions,
    like_args,
    owed_said,
    owed_work,
    restore,
    resume_args,
    resumed_threshold,
    set_aside_newer,
    still_due,
)
from learner.rundir import cannot_write, writing
from learner.served import given_kwargs_differ, other_task
from learner.specs import other_env_servers
from learner.stats import mean_of
from learner.update import Batch, Rollout, UpdateResult, make_batch, ppo_update

if TYPE_CHECKING:
    from learner.tracking import WandbRun

__all__ = [
    "Args",
    "NothingToLearnError",
    "Rollout",
    "UnusableEnvOutputError",
    "like_args",
    "resume_args",
    "train",
]
# (like_args and resume_args live in learner.resume: README's Python API imports them from here)

log = logging.getLogger(__name__)

LOST_ROLLOUTS = 3
"""Rollouts in a row ended by a failed env server (--no-fault-tolerant) at which the run gives up: the
earlier ones are dropped with a warning, this one raises."""

EMPTY_ROLLOUTS = LOST_ROLLOUTS
"""Rollouts in a row in which no env gave a transition (every env raised, or was unavailable) after
which the run stops with NothingToLearnError."""

PROGRESS_LINE_S = 60.0
"""How often ``learner train`` without a terminal (no progress bar) prints a progress line (and once
after its first update, so that a log shows the run under way at once, not a minute later)."""


class NothingToLearnError(EnvFleetError):
    """No env gave a transition for ``EMPTY_ROLLOUTS`` rollouts in a row: the run stops (its envs' errors
    are in the message)."""


def _args_for_served_env(args: Args, envs: Any, env_id: str) -> Args:
    """``args`` for a run on running servers (--servers), whose env ``env_id`` is what they serve: ValueError
    where --env names another (for a resumed run, the env it trained on), else ``args`` naming ``env_id``."""
    # The fleet's env is its first server's (a fleet's servers need only fit one another's spaces: others
    # are warned of as they connect); an error names each server with the env it serves.
    served_envs = getattr(envs, "served_envs", None) or {args.servers: env_id}
    other = other_env_servers(args.env, served_envs) if args.env is not None and args.env != env_id else ""
    if args.resume and other:
        first = next((a for a, e in served_envs.items() if e == args.env), None)
        raise ValueError(
            f"--servers: the run in {args.resume} trained on {args.env}, but {other}; resume it on servers "
            f"of {args.env}"
            + (
                f" (a mixed fleet's env is its first server's, and its time limit and kwargs too: list one "
                f"of {args.env} first, {first} say, as the run did)"
                if first is not None
                else ""
            )
        )
    if other:
        raise ValueError(
            f"--env: expected servers of {args.env}, but {other} (leave --env out to train on whatever they serve)"
        )
    return dataclasses.replace(args, env=env_id)  # config.json and checkpoints name the env trained on


def _served(args: Args, envs: Any) -> dict[str, Any]:
    """What ``envs`` are beyond their id (recorded: eval makes the same ones for a run on --servers): their
    wrappers, max_episode_steps and env kwargs."""
    return {
        "wrappers": list(getattr(envs, "wrappers", args.server_wrappers())),
        # (as the servers said, None from servers too old to say; in-process envs: as open_fleet made them)
        "max_episode_steps": getattr(envs, "time_limit", None)
        or getattr(getattr(envs, "spec", None), "max_episode_steps", None),
        "env_kwargs": getattr(envs, "env_kwargs", None),
    }


def _autoreset_mode(envs: Any) -> gym.vector.AutoresetMode:
    """``envs``' autoreset mode (NextStep where they do not say); ValueError where it is neither NextStep nor
    SameStep."""
    autoreset = envs.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    if autoreset not in (gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP):
        raise ValueError(
            f"envs: expected autoreset mode NextStep or SameStep, got {getattr(autoreset, 'value', autoreset)} "
            "(PPO's rollouts reset ended envs as they step: start the servers with --autoreset-mode NextStep)"
        )
    return autoreset


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


def clip_leaves_out_zero(hp: PPOConfig, action_space: gym.Space[Any]) -> str:
    """A warning where --action-bounds clip meets Box bounds that leave 0 out (Box(10, 12)): the Gaussian
    starts at mean 0, std 1, so most or all of its samples clip to the bound nearest 0, the same action
    each time, whose rewards tell it nothing of which way to move (its log-prob is that of the unclipped
    sample): it may learn nothing at all, without an error; "" otherwise."""
    if hp.action_bounds != "clip" or not isinstance(action_space, gym.spaces.Box):
        return ""
    low, high = (np.asarray(bound, dtype=np.float64).reshape(-1) for bound in (action_space.low, action_space.high))
    out = np.flatnonzero((low > 0) | (high < 0))
    if not len(out):
        return ""
    shown = ", ".join(f"{i} [{low[i]:g}, {high[i]:g}]" for i in out[:8])
    if len(out) > 8:
        shown += f" and {len(out) - 8} more"
    return (
        f"--action-bounds clip: the bounds of action dimension{'s' if len(out) > 1 else ''} {shown} leave out 0, "
        "where the policy's Gaussian starts (mean 0, std 1): most or all of its samples clip to the bound nearest "
        "0, the same action each time, whose rewards tell it nothing of which way to go, so it may learn nothing; "
        "pass --action-bounds squash (tanh onto the bounds), or rescale the actions around 0 in the env "
        "(gymnasium's RescaleAction)"
    )


def _resumed_kwargs_hint(args: Args, checkpoint: dict[str, Any]) -> str:
    """For a resumed run whose envs have other spaces than its nets: the env kwargs these envs were made
    with, where they are not the run's (``learner train --resume RUN --env-kwargs ...``: kwargs can change
    an env's spaces, LunarLander's ``continuous`` say, and the error named the spaces alone). The run's are
    its options' (a run on running servers: what they said, which a run moved off them takes along). ""
    on running servers (their kwargs are theirs: --env-kwargs does not go with --servers), for a run whose
    servers did not say, or where nothing differs. Worded as eval's: :func:`~learner.served.given_kwargs_differ`."""
    saved = checkpoint["args"]
    if args.servers is not None:
        return ""
    if saved.get("servers") is None:
        run_kwargs = saved.get("env_kwargs") or {}
    else:  # (not the served record of a run's own envs: the atari wrapper adds frameskip=1 there)
        run_kwargs = (checkpoint.get("served") or {}).get("env_kwargs")
    differ = given_kwargs_differ(dict(args.env_kwargs), run_kwargs, leave_out_to="resume it with the run's")
    return f" (these envs were {differ})" if differ else ""


def _check_resumed_envs(args: Args, checkpoint: dict[str, Any], envs: Any, fleet: FleetSpec) -> None:
    """ValueError where the envs of a resumed run (``fleet``'s ``envs``) have other spaces than its nets were
    trained on (``checkpoint``'s); a warning where running servers make another task of the same spaces."""
    for what, space in (("observation", envs.single_observation_space), ("action", envs.single_action_space)):
        if str(space) != checkpoint[f"{what}_space"]:
            raise ValueError(
                f"--resume: the run in {args.resume} trained its nets on {what}s {checkpoint[f'{what}_space']}, "
                f"but these envs ({fleet.describe()}) have {space}; resume it on the same env, wrappers "
                f"and env kwargs{_resumed_kwargs_hint(args, checkpoint)}"
            )
    if args.servers is not None:
        # Running servers make their envs as they were started: the same id and spaces may be another
        # task (time limit, env kwargs, wrappers), which the nets then go on learning. Warned of, as
        # learner eval does, not refused: a run may be moved to a variant of its task on purpose.
        differ = other_task(checkpoint.get("served") or {}, envs)
        if differ:
            log.warning(
                "--servers: the servers at %s make their envs otherwise than the envs the run in %s trained "
                "on: %s; the resumed run goes on learning that task, not the run's (resume on servers started "
                "as the run's to keep to its task; the checkpoints record the task it trains on from here)",
                args.servers,
                args.resume,
                "; ".join(differ),
            )


def _returned_when(step: int, reset: bool = False) -> str:
    """The end of a message about what an env returned: ", returned by its step at the run's env step 1,024"."""
    return f", returned by {'its reset' if reset else 'its step'} at the run's env step {step:,}"


def _stepping(envs: Any) -> tuple[Any, bool]:
    """How a rollout steps ``envs``: (``step_groups``, ``overlap``). Pipelining (RemoteVectorEnv with
    --pipeline-groups > 1, as many groups as servers allow): step_groups sends each group its actions as
    soon as they are computed; else vector envs that step in the background (RemoteVectorEnv:
    step_async) do so while the critic runs (``overlap``)."""
    step_groups = getattr(envs, "step_groups", None) if getattr(envs, "num_groups", 1) > 1 else None
    return step_groups, step_groups is None and hasattr(envs, "step_async") and hasattr(envs, "step_wait")


def _step_envs(
    envs: Any,
    stepping: tuple[Any, bool],
    acting: Acting,
    next_obs: Obs,
    rollout: Rollout,
    step: int,
    *,
    raw_obs: np.ndarray,
    num_envs: int,
) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """One step of every env of ``envs``, on the actions ``acting`` takes on ``next_obs`` (stored in ``rollout``
    at ``step``; ``raw_obs``: the ``num_envs`` envs' observations as they gave them), as :func:`_stepping` says
    (``stepping``): what ``envs.step`` returns."""
    step_groups, overlap = stepping
    if step_groups is not None:
        # Each group of servers steps while the policy runs on the next group's envs.
        return step_groups(functools.partial(acting.act, next_obs, rollout, step, raw_obs=raw_obs, num_envs=num_envs))
    if overlap:
        acting.act(next_obs, rollout, step, slice(None), send=envs.step_async, raw_obs=raw_obs, num_envs=num_envs)
        return envs.step_wait()
    return envs.step(acting.act(next_obs, rollout, step, slice(None), raw_obs=raw_obs, num_envs=num_envs))


def _asked_stop(stop: StopRequest) -> str:
    """summary.json's ``stop_reason`` for a run that ``stop`` stopped: "interrupted" by a signal (Ctrl-C,
    SIGTERM, SIGHUP), "stopped" by the caller's event."""
    if not stop.signalled:
        log.info("the stop event was set: the run stops here (checkpoint and summary follow)")
    return "interrupted" if stop.signalled else "stopped"


def _stop_reason(err: BaseException) -> str:
    """summary.json's ``stop_reason`` for a run that ``err`` ended."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    return f"error: {type(err).__name__}: {err}" if str(err) else f"error: {type(err).__name__}"


ENV_ERROR_LOG_S = 60.0
"""How often, at most, learner train logs an env's error (the first at once; the count in between)."""


def _say_env_error(said: LogBudget, total: int, env: int, infos: dict[str, Any], where: str = "") -> None:
    """Log that env ``env`` raised in its step (its server isolated the error: its episode was cut), the
    first at once, then at most every :data:`ENV_ERROR_LOG_S` (``said``'s interval); ``where``: its server and
    its index there (:func:`_env_on_server`), which that server's log knows it by."""
    if said.due() is None:
        return
    text = str(infos["env_error"][env])
    # (an env whose reset raised is out of order: its server tries a reset at each step, each an env error)
    what = (
        "is out of order (its reset failed; tried again at each step)"
        if text.startswith("out of order")
        else "returned what cannot be used (its episode was cut short, and the env reset)"
        if env_returned(text)
        else "raised (its episode was cut short, and the env reset)"
    )
    log.warning(
        "env %d%s %s: %s (%d env error%s in this run so far; one such line a minute at most)",
        env,
        where,
        what,
        text if len(text) <= 300 else text[:300] + "...",
        total,
        "" if total == 1 else "s",
    )


def _count_env_errors(infos: dict[str, Any], envs: Any, errors: dict[str, int], said: LogBudget, before: int) -> int:
    """How many of ``envs`` raised in the step that gave ``infos`` (``infos["env_error"]``); their errors counted
    in ``errors`` (text -> env steps: for the error of a run that has nothing to learn from), the first logged
    (:func:`_say_env_error`, with ``before``, the run's env errors before this step)."""
    if "_env_error" not in infos:
        return 0
    raised = np.flatnonzero(infos["_env_error"])
    for i in raised:
        text = str(infos["env_error"][i]).removeprefix("out of order since ")
        errors[text] = errors.get(text, 0) + 1
    if len(raised):
        first = int(raised[0])
        _say_env_error(said, before + len(raised), first, infos, _env_on_server(envs, first))
    return len(raised)


RAW_INTEGERS_WARN_AT = 100
"""Integer vector observations ranging past this go raw into the MLP only with a warning (ALE's RAM: 0-255)."""


def _raw_integer_observations(space: gym.Space[Any], image: bool, norm_obs: bool) -> str:
    """A warning where the MLP gets integer observations as they are, with values as large as ALE's RAM
    bytes (0-255: obs_type="ram"), which slow or stall learning where they are not scaled; "" otherwise
    (floats, small integer ranges such as a grid's cells, --norm-obs, images for the Nature CNN). A Dict's
    vector keys are looked at each, the first such named ("observations['ram'] are uint8 values ..."): the MLP
    gets them as it would a Box of them, and --norm-obs scales them alone."""
    if isinstance(space, gym.spaces.Dict):
        for key in vector_keys(space):
            said = _raw_integer_observations(space[key], False, norm_obs)
            if said:
                return said.replace("observations are", f"observations[{key!r}] are", 1)
        return ""
    if image or norm_obs or not isinstance(space, gym.spaces.Box) or not np.issubdtype(space.dtype, np.integer):
        return ""
    largest = int(max(np.max(np.abs(space.low.astype(np.int64))), np.max(np.abs(space.high.astype(np.int64)))))
    if largest < RAW_INTEGERS_WARN_AT:
        return ""
    return (
        f"observations are {space.dtype} values of up to {largest} ({space}), which the MLP gets as they are: "
        "inputs that large slow or stall learning; --norm-obs scales them (a running mean and std, kept in the "
        "checkpoints), or scale them in a wrapper on the env servers"
    )


def _env_on_server(envs: Any, env: int) -> str:
    """Where env ``env`` (counted over the fleet) runs, for a log line: " (env server ADDRESS, its env 1)",
    as its server counts its own envs, a server the learner started by its label (" (env server local-0, its
    env 1)"); "" for in-process envs (no server). (The fleet as of now, the step's: it changes only between
    rollouts.)"""
    where = server_of(envs, env)
    return f" (env server {label_of(where[0])}, its env {where[1]})" if where is not None else ""


DROPPED_LOG_S = 60.0
"""How often, at most, learner train logs a rollout dropped because an env raised (--no-fault-tolerant): the
first at once, then one line with the count since. Its server stays, so an env that raises every few
hundred steps drops a rollout in every few, each a warning (and a line on stdout: see :func:`train`'s
``on_fleet_change``), though three in a row only stop the run."""


def _say_dropped(said: list[Any], dropped: int, in_a_row: int, err: RemoteEnvError) -> bool:
    """Log that the rollout under way is dropped for ``err``, the session's ``dropped``-th and the ``in_a_row``-th
    in a row (--no-fault-tolerant: a step failed). Where an env raised, the first at once, then at most every
    :data:`DROPPED_LOG_S` (``said``: when last, and the count then); but each one of a row of them, which
    :data:`LOST_ROLLOUTS` in a row end, and a server lost (it leaves the fleet, which is rare, and it goes
    with the fleet's line about it). Whether it was said (else at DEBUG)."""
    now = time.monotonic()
    crashed = isinstance(err, EnvCrashedError)
    if crashed and in_a_row == 1 and said[1] and now - said[0] < DROPPED_LOG_S:
        log.debug("dropping this rollout, every env starts over: %s", err)
        return False
    since = dropped - said[1]
    count = f"{dropped} rollout{'s' if dropped > 1 else ''} dropped so far"
    if in_a_row > 1:
        count = f"{in_a_row} in a row ({LOST_ROLLOUTS} in a row stop the run), {count}"
    if since != dropped:
        count += f" ({since} since the last such line{'; one a minute at most' if crashed else ''})"
    elif crashed:
        count += " (one such line a minute at most)"
    # (summary.json, metrics.jsonl and the closing faults line count them there: in env steps, not rollouts)
    count += f", {'their' if dropped > 1 else 'its'} env steps counted in env_steps_lost"
    if crashed:
        log.warning("dropping this rollout, every env starts over: %s; %s", err, count)
    else:
        log.warning("dropping this rollout, going on without env server %s: %s; %s", label_of(err.address), err, count)
    said[0], said[1] = now, dropped
    return True


@dataclasses.dataclass(eq=False)
class _Drops:
    """Rollouts a failed step cut short (without --fault-tolerant: a server stopped or vanished, or an env raised):
    dropped, and the run goes on with the servers left (every env starting over), unless :data:`LOST_ROLLOUTS`
    come in a row."""

    lost: RemoteEnvError | None = None
    """The server that failed during the last rollout (its failure; None: none did)."""
    in_a_row: int = 0
    """Rollouts in a row that a failed step cut short."""
    dropped: int = 0
    """Rollouts dropped for a failed step (--no-fault-tolerant), this session."""
    said: list[Any] = dataclasses.field(default_factory=lambda: [0.0, 0])
    """(when a dropped rollout was last logged, and the count then)"""
    unsaid: bool = False
    """The last rollout was dropped without a line (see :func:`_say_dropped`)."""

    def to_follow(self) -> tuple[list[str], bool]:
        """Before the fleet is followed: the addresses of the servers it goes on without (the server lost in the
        last rollout; none where an env raised: its server stays), and whether that rollout was dropped without a
        line; neither is kept."""
        lost = self.lost
        drop = [lost.address] if lost is not None and not isinstance(lost, EnvCrashedError) else []
        unsaid = self.unsaid
        self.lost, self.unsaid = None, False
        return drop, unsaid

    def failed(
        self,
        err: RemoteEnvError,
        counters: Counters,
        since: _SinceUpdate,
        *,
        num_envs: int,
        stop: StopRequest,
        can_drop: bool,
    ) -> bool:
        """A step of the ``num_envs`` envs failed with ``err``: whether the rollout under way ends there (dropped,
        counted in ``since`` and said; or the run was asked to stop: ``stop``), else the run ends with ``err``
        (the caller raises it): where the rollout cannot be dropped (``can_drop``: the fleet is followed, not
        fault-tolerant), :data:`LOST_ROLLOUTS` come in a row, or an env's observation does not fit the space (or its
        infos make an answer too large to send: see :func:`~learner.faults.misfit_reported`)."""
        self.in_a_row += 1
        if isinstance(err, EnvCrashedError):
            # (the step was taken, an env raising in it: its env steps counted as a fault-tolerant
            # run counts them, and lost with the rollout's however it ends)
            counters.global_step += num_envs
        if stop.requested:  # (Ctrl-C during a step that then failed: stopped there)
            log.warning("the step under way when the stop was asked failed: %s; stopping there", err)
            self.lost = err
            return True
        # (an env's observation that does not fit the space, or infos too large to send: the same after every reset)
        if not can_drop or self.in_a_row >= LOST_ROLLOUTS or misfit_reported(err):
            return False
        if isinstance(err, EnvCrashedError):  # the server is fine: it stays
            since.env_errors += 1  # (of the env steps lost: the raise's step is among them)
        self.dropped += 1
        self.unsaid = not _say_dropped(self.said, self.dropped, self.in_a_row, err)
        self.lost = err
        return True


def _servers_up(envs: Any, watch: FleetWatch) -> tuple[list[str], int, int]:
    """The fleet's servers up now, as metrics name them (``watch.label``), how many of its others are down
    (``faults/servers_down`` as the next update's row will count them) and their envs: where a step finds a server
    back after every one was down (``Recorder.fleet_up``)."""
    addresses, slices = list(getattr(envs, "addresses", ())), list(getattr(envs, "env_slices", ()))
    available = np.asarray(getattr(envs, "available", True), dtype=bool)
    if available.ndim == 0 or len(slices) != len(addresses):  # (envs that do not say: none is counted down)
        return [watch.label(address) for address in addresses], 0, 0
    up = [watch.label(address) for address, sl in zip(addresses, slices, strict=True) if available[sl].all()]
    return up, len(addresses) - len(up), int((~available).sum())


def unavailable_envs(infos: dict[str, Any], num_envs: int) -> np.ndarray:
    """Bool per env: its step gave no transition (``env_unavailable`` from a fault-tolerant fleet, or an
    ``env_error`` an env server isolated, which in-process envs built by env_server report too)."""
    lost = np.zeros(num_envs, dtype=bool)
    for key in ("_env_unavailable", "_env_error"):
        mask = infos.get(key)
        if mask is not None:
            lost |= np.asarray(mask, dtype=bool)
    return lost


def nothing_to_learn(rollouts: int, errors: dict[str, int], in_process: bool = False) -> str:
    """NothingToLearnError's message: ``rollouts`` in a row gave no transition; ``errors``: what the envs
    reported in them (``infos["env_error"]`` text -> env steps), the most frequent named; ``in_process``:
    the envs run here (--backend gym), not on env servers."""
    if errors:
        ranked = sorted(errors.items(), key=lambda item: -item[1])
        cause = "the envs reported: " + "; ".join(f"{text} ({count:,} env steps)" for text, count in ranked[:3])
        if len(ranked) > 3:
            cause += f"; and {len(ranked) - 3} other errors"
        cause += " (the log above has the tracebacks)" if in_process else " (the env servers log the tracebacks)"
    else:
        cause = (
            "every env's server was unavailable, or was lost before its envs gave a transition (see the warnings above)"
        )
    where = f"{rollouts} rollouts in a row" if rollouts > 1 else "the run's rollout"
    return f"no env gave a transition in {where}: nothing to learn from, the run stops; {cause}"


def _warn_of_settings(
    args: Args,
    hp: PPOConfig,
    device: torch.device,
    obs_space: gym.Space[Any],
    action_space: gym.Space[Any],
    image: bool,
) -> None:
    """Warn of settings that slow the run or that these spaces make useless (ignored options among them), once
    torch's threads are set (``image``: the observations are images, the CNN's)."""
    busy = machine_busy() if image and device.type == "cpu" and not args.torch_threads else ""
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
    if args.norm_obs and isinstance(obs_space, gym.spaces.Dict):
        if not vector_keys(obs_space):
            log.warning("--norm-obs: applies to a Dict's vector (Box) keys, and %s has none; ignored", obs_space)
    elif args.norm_obs and not (isinstance(obs_space, gym.spaces.Box) and not image):
        what = "image" if image else str(obs_space)
        log.warning("--norm-obs: applies to vector (Box) observations, not %s ones; ignored", what)
    raw_integers = _raw_integer_observations(obs_space, image, hp.norm_obs)
    if raw_integers:
        log.warning("%s", raw_integers)
    if args.action_bounds is not None and not isinstance(action_space, gym.spaces.Box):
        log.warning("--action-bounds: applies to Box actions, not %s; ignored", action_space)
    clipped = clip_leaves_out_zero(hp, action_space)
    if clipped:
        log.warning("%s", clipped)
    if args.hang_timeout is not None and args.backend == "gym":
        log.warning("--hang-timeout: applies to env servers this command starts, not in-process envs; ignored")


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


def _policy_name(obs_space: gym.Space[Any], image: bool, hp: PPOConfig) -> str:
    """What config.json says the policy is: "Nature CNN", "MLP 64,64", or for Dict observations "Dict: Nature CNN
    per image key, MLP 64,64" (images' CNNs and the other keys' features concatenated under the MLPs)."""
    mlp = f"MLP {','.join(map(str, hp.hidden_sizes))}"
    if isinstance(obs_space, gym.spaces.Dict):
        return f"Dict: Nature CNN per image key, {mlp}" if image_keys(obs_space) else f"Dict: {mlp}"
    return "Nature CNN" if image else mlp


ObsStorage = tuple[tuple[int, ...] | dict[str, tuple[int, ...]], torch.dtype | dict[str, torch.dtype]]


def _obs_storage(obs_space: gym.Space[Any]) -> ObsStorage:
    """The shape and dtype a rollout stores an observation in: images as the bytes they are. For a Dict, a shape
    and a dtype per key (its images uint8, its Discrete and MultiDiscrete values int64, its MultiBinary values
    uint8, its other Boxes float32)."""
    if isinstance(obs_space, gym.spaces.Dict):
        stored = {key: _obs_storage(value) for key, value in obs_space.spaces.items()}
        return (
            {key: shape for key, (shape, _) in stored.items()},  # type: ignore[misc]
            {key: dtype for key, (_, dtype) in stored.items()},  # type: ignore[misc]
        )
    if is_image_space(obs_space) or isinstance(obs_space, gym.spaces.MultiBinary):
        dtype = torch.uint8
    elif isinstance(obs_space, gym.spaces.MultiDiscrete):
        dtype = torch.int64
    else:
        dtype = torch.int64 if isinstance(obs_space, gym.spaces.Discrete) else torch.float32
    return tuple(obs_space.shape or ()), dtype


_UNITS = ((1e9, 2, "GB"), (1e6, 1, "MB"), (1e3, 1, "kB"))

ROLLOUT_BYTES_PER_STEP = 64
"""A rollout's bytes per env step besides its observation, generously: action, log-prob, value, reward, flags,
advantage and return, and the update's copies of them."""


def _check_rollout_memory(
    hp: PPOConfig,
    num_envs: int,
    shape: tuple[int, ...] | dict[str, tuple[int, ...]],
    dtype: torch.dtype | dict[str, torch.dtype],
    device: torch.device,
    *,
    overlap: bool = False,
) -> None:
    """Refuse a rollout whose storage and update cannot fit where they go (found before the run dir is made: at
    the allocation a CPU that overcommits has the kernel kill the learner later, without a word). Counted: the
    rollout's observations, the update's copy of them, a minibatch taken from it and made float32 for the nets (not
    the nets' activations: at least that much is needed); with ``overlap`` (--overlap-update) a second copy, the
    batch of the update still running in the background as the next rollout's batch is made. ``shape``,
    ``dtype``: an observation's in the rollout (:func:`_obs_storage`; a Dict's: per key, their bytes summed)."""
    steps = hp.num_steps * num_envs
    if isinstance(shape, dict):
        assert isinstance(dtype, dict)
        parts = [(math.prod(part), dtype[key].itemsize) for key, part in shape.items()]
    else:
        assert not isinstance(dtype, dict)
        parts = [(math.prod(shape), dtype.itemsize)]
    obs_bytes = sum(size * itemsize for size, itemsize in parts)
    minibatch = steps // hp.num_minibatches * sum(size * (itemsize + 4) for size, itemsize in parts)
    need = (3 if overlap else 2) * steps * obs_bytes + minibatch + steps * ROLLOUT_BYTES_PER_STEP
    available = available_memory(device)
    if available is None or need <= available[0]:
        return
    free, where = available

    def amount(size: int) -> str:
        return next(
            f"{size / scale:,.{places}f} {unit}" for scale, places, unit in _UNITS if size >= scale or unit == "kB"
        )

    def described(shape: tuple[int, ...], dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        return f"{tuple(shape)} {name}" if shape else f"scalar {name}"

    if isinstance(shape, dict):
        assert isinstance(dtype, dict)
        what = "Dict (" + ", ".join(f"{key!r}: {described(part, dtype[key])}" for key, part in shape.items()) + ")"
    else:
        assert not isinstance(dtype, dict)
        what = described(shape, dtype)
    raise OptionError(
        f"--num-steps {hp.num_steps} x {num_envs} envs: a rollout of {what} "
        f"observations and its update need at least {amount(need)} on {device}, and {where} has {amount(free)} available: "
        "lower --num-steps or the number of envs (or free memory)"
    )


def _checkpoint_to_resume(args: Args) -> tuple[Args, Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """What --resume resumes: ``args`` as the run goes on with them (a run dir without a checkpoint started over
    in it; a checkpoint file's run going on in its run dir), the checkpoint's file and what it holds (None for a
    run that is not resumed), and the newer checkpoints torch cannot read, with why."""
    if args.resume and Path(args.resume).is_dir() and not rundir.list_checkpoints(args.resume):
        # Stopped before its first checkpoint (killed in its first update, a full disk): nothing to go on
        # from, so it starts over with the options it was started with, where it was. (Not a run that had
        # checkpoints, deleted or lost since: refused, its files as they are.)
        rundir.check_starts_over(Path(args.resume), "--resume")
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
    # The run's paths are absolute from here on: a chdir while it trains (a notebook's %cd, with train() in
    # a thread) would put the later files of a relative run dir in another folder.
    if args.resume and Path(args.resume).is_dir():
        checkpoint_file, checkpoint, unreadable = load_latest_readable(Path(args.resume).absolute())
    elif args.resume:
        checkpoint_file = find_checkpoint(Path(args.resume).absolute())
        checkpoint = load_checkpoint(checkpoint_file, resuming=True)
        if args.run_dir is None:  # (a checkpoint file: its run goes on in the run dir it is in)
            if checkpoint_file.parent.name != rundir.CHECKPOINTS:
                raise ValueError(
                    f"resume: {args.resume} is a checkpoint outside a run dir's {rundir.CHECKPOINTS}/ folder; give "
                    "run_dir, the run dir the resumed run goes on in"
                )
            args = dataclasses.replace(args, run_dir=str(checkpoint_file.parent.parent))
    return args, checkpoint_file, checkpoint, unreadable


def _lock_given_dir(
    stack: contextlib.ExitStack,
    given_dir: str,
    unreadable: list[tuple[Path, str]],
    checkpoint_file: Path | None,
    checkpoint: dict[str, Any] | None,
) -> None:
    """Lock the run dir the command named (``given_dir``, which is there) for the run (unlocked by ``stack``), and
    set aside what resuming it does not use: the ``unreadable`` checkpoints and those newer than the one it
    resumes from (``checkpoint``, read from ``checkpoint_file``)."""
    stack.enter_context(rundir.lock(given_dir))
    for moved in rundir.set_aside_unreadable(path for path, _ in unreadable):
        log.warning("%s set aside as %s", moved.with_suffix(""), moved.name)
    if checkpoint is not None and checkpoint_file is not None:
        set_aside_newer(Path(given_dir), checkpoint_file, checkpoint)


def _check_fresh(run_dir: Path) -> None:
    """A run dir a new run can be written to (not made yet: a run that fails to start leaves none), or
    one whose run stopped before its first checkpoint (set aside: see :func:`rundir.set_aside`)."""
    rundir.check_makeable(run_dir, "--run-dir", not_a_folder=FileExistsError)
    if rundir.list_checkpoints(run_dir):  # (one without: stopped before its first, it starts over)
        raise FileExistsError(
            f"--run-dir {run_dir} already holds a run; pass --resume {run_dir} to continue it, or another --run-dir"
        )
    rundir.check_holds_a_run(run_dir)  # (files by a run's names that are no run's: not set aside as a run's)
    rundir.check_starts_over(run_dir, "--run-dir")  # (a run whose step checkpoints went: not set aside either)


def _make_run_dir(
    stack: contextlib.ExitStack[Any], given_dir: str | None, env_id: str, *, fresh: bool, locked: bool
) -> Path:
    """The run dir, made (``given_dir``, or a new one named after ``env_id``) and locked on ``stack`` unless it
    was (``locked``); for a ``fresh`` run (not resumed) in ``given_dir``, checked to hold no run, the files of
    one stopped before its first checkpoint set aside."""
    run_dir = Path(given_dir or default_run_dir(env_id)).absolute()
    if fresh and given_dir:
        _check_fresh(run_dir)  # (again: another run may have taken it while the servers started)
    try:
        if given_dir:
            run_dir.mkdir(parents=True, exist_ok=True)
        else:  # runs started in the same second (seeds in parallel) each get their own
            run_dir = rundir.make_new_dir(run_dir)
    except OSError as err:
        raise ValueError(f"--run-dir: cannot make {run_dir}: {os_reason(err)}") from None
    if not locked:
        stack.enter_context(rundir.lock(run_dir))
    if fresh and given_dir:
        _check_fresh(run_dir)  # (held now: no other learner writes it from here on)
        aside = rundir.set_aside(run_dir)
        if aside is not None:
            log.warning(
                "--run-dir %s held a run that stopped before its first checkpoint: its files are moved to %s, "
                "and this run starts over",
                run_dir,
                aside,
            )
    return run_dir


def _run_config(
    args: Args,
    hp: PPOConfig,
    envs: Any,
    *,
    env_id: str,
    fleet: FleetSpec,
    served: dict[str, Any],
    autoreset: gym.vector.AutoresetMode,
    device: torch.device,
    image: bool,
    threshold: float | None,
    run_dir: Path,
    resumed_at_step: int | None,
) -> dict[str, Any]:
    """What config.json holds of a run in ``run_dir`` of ``args`` (its PPO settings ``hp``) on ``envs`` (``env_id``,
    as ``fleet`` describes them, ``served``: what they are beyond their id), on ``device``; ``resumed_at_step``:
    for a resumed run, the step its checkpoint was saved at (else None)."""
    resumed = resumed_at_step is not None
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    recorded_args = args.to_json()
    if resumed and not args.track and (run_dir / rundir.WANDB_RUN).is_file():
        # A tracked run resumed with --no-track: not tracked this time, and recorded as tracked, so
        # that its later sessions go on in its W&B run as a plain --resume does.
        recorded_args["track"] = True
    return {
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
        "machine": machine_info(device),
        "policy": _policy_name(obs_space, image, hp),
        "solved_threshold": threshold,
        "versions": run_versions(),
        "server_versions": getattr(envs, "server_versions", {}),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resumed_at_step": resumed_at_step,
        "earlier_sessions": earlier_sessions(run_dir) if resumed else [],
    }


def _say_started(
    config: dict[str, Any],
    hp: PPOConfig,
    fleet: FleetSpec,
    envs: Any,
    *,
    env_id: str,
    device: torch.device,
    run_dir: Path,
    counters: Counters,
    live: LearnerMetrics | None,
    on_start: Callable[[dict[str, Any]], None] | None,
    resumed_from: str | None,
) -> None:
    """Say that the run of ``env_id`` in ``run_dir`` (config.json's ``config``) starts, at ``counters``: in the log,
    to the served metrics (``live``: --metrics-port) and to train()'s ``on_start``; ``resumed_from``: a resumed
    run's checkpoint (else None)."""
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
        resumed = (
            {"resumed_from": resumed_from, "resumed_step": counters.global_step} if resumed_from is not None else {}
        )
        on_start({**config, "run_dir": str(run_dir), **resumed})  # (config's metrics_url included)


def _events_writer(
    stack: contextlib.ExitStack, run_dir: Path, config: dict[str, Any], *, resumed_at_step: int | None
) -> tuple[EventsWriter, set[str]]:
    """--tensorboard: the writer of ``run_dir``'s events (closed by ``stack``), and the faults/ tags its rows
    started so far (see write_tensorboard); ``resumed_at_step``: for a resumed run, its checkpoint's step."""
    faults_seen: set[str] = set()
    if resumed_at_step is not None and (run_dir / rundir.METRICS).is_file():  # (the rows restore kept)
        faults_seen = fault_tags_started(rundir.iter_jsonl(run_dir / rundir.METRICS))  # (row by row: a long run's)
    # A resumed run hides the events the killed run wrote after its checkpoint (they are redone).
    purge_step = resumed_at_step + 1 if resumed_at_step is not None else None  # (its own update's kept)
    writer = stack.enter_context(contextlib.closing(EventsWriter(run_dir, purge_step)))
    if resumed_at_step is None:  # (CleanRL's table of the run's settings: once, at its start)
        writer.add_text("hyperparameters", hyperparameters_text(config), 0)
    return writer, faults_seen


def _close_quietly(f: Any) -> None:
    with contextlib.suppress(OSError):
        f.close()


def check_reward_scaler(
    scaler: RewardScaler, rollout: Rollout, server_of: Callable[[int], str], global_step: int
) -> None:
    """Raise UnusableEnvOutputError where the variance of the discounted returns that --norm-reward scales the
    rewards by (updated with ``rollout``'s, ending at env step ``global_step``) overflowed float64: returns
    beyond about 1e154 (rewards --norm-reward takes beyond float32's range), which would scale every reward to
    0 from then on. Names the env of the rollout's largest reward. (One number read back a rollout.)"""
    if math.isfinite(scaler.rms.var.item()):
        return
    size = np.where(rollout.valid, np.abs(rollout.rewards), -1.0)
    step, env = (int(i) for i in np.unravel_index(int(np.argmax(size)), size.shape))
    raise UnusableEnvOutputError(
        f"{server_of(env)}reward of env {env} is {rollout.rewards[step, env]:.6g} at step {step + 1} of the rollout "
        f"ending at env step {global_step:,}: too large for --norm-reward, the variance of the discounted returns it "
        "scales the rewards by overflowed float64 (returns beyond about 1e154 cannot be scaled); pass --clip-reward, "
        "or scale the rewards in a wrapper on the env servers"
    )


class Acting:
    """How the loop turns the envs' observations into the policy's actions: observations onto the device
    (normalised with --norm-obs), the ``actor``'s actions (``agent``'s nets, or their copy with
    --overlap-update) as the envs take them, and errors of the policy's forward that an observation explains."""

    def __init__(
        self,
        *,
        agent: Agent,
        actor: Agent,
        obs_space: gym.Space[Any],
        action_space: gym.Space[Any],
        obs_rms: RunningMeanStd | DictRunningMeanStd | None,
        obs_dtype: torch.dtype | dict[str, torch.dtype],
        device: torch.device,
        server_of: Callable[[int], str] = lambda env: "",
    ) -> None:
        self.agent, self.actor = agent, actor
        self.obs_space, self.action_space = obs_space, action_space
        self.obs_rms, self.obs_dtype, self.device = obs_rms, obs_dtype, device
        self.server_of = server_of
        """Env index -> what names its server at the start of an error (see :func:`env_server_of`)."""
        self.looks_first = obs_rms is not None or isinstance(action_space, gym.spaces.Box)
        """Whether :meth:`prepare_obs` looks at the envs' observations as they come, before the statistics
        take them and the policy acts on them: with --norm-obs (one NaN would make the statistics NaN for
        good, and with them every env's normalised observations, so that the error named env 0) and for Box
        actions (the Gaussian samples NaN from NaN without an error, which would go to the envs as actions,
        to be refused as theirs). Elsewhere (a categorical policy without --norm-obs) the CPU's forward
        raises on NaN, and :meth:`acting_on` explains its error after it: no step pays for the pass."""

    def prepare_obs(
        self,
        obs: Any,
        update_stats: bool,
        stale: np.ndarray | None = None,
        *,
        returned_at: int | None = None,
        reset: bool = False,
    ) -> Obs:
        """One batch of observations onto the device (one copy), normalised when asked; ``stale``
        envs (unavailable: placeholders or old observations) do not update the statistics.

        ``returned_at``, for observations as the envs returned them (by a step, or a reset with ``reset``):
        the run's env steps then. With :attr:`looks_first`, an observation the policy cannot act on is then
        an UnusableEnvOutputError naming its env, its server and that step (one pass over the batch on the
        host: 2-5 microseconds a step for vector observations, 13 for 64 envs' 376 float64 values).

        Dict observations come as a batch per key and go to the device so (a copy per key), each in its rollout
        dtype; with --norm-obs only their vector keys are normalised (:class:`DictRunningMeanStd`)."""
        obs_rms, device = self.obs_rms, self.device
        obs = _as_arrays(obs)
        if returned_at is not None and self.looks_first:
            as_float32 = obs_rms is None  # (--norm-obs scales float64 observations before the nets see them)
            if not observations_usable(obs, self.obs_space, as_float32=as_float32):
                raise_unusable(
                    obs,
                    self.obs_space,
                    range(_num_rows(obs)),
                    self.server_of,
                    as_float32=as_float32,
                    when=_returned_when(returned_at, reset),
                )
        if isinstance(obs, dict):
            assert isinstance(self.obs_dtype, dict)
            x = {key: torch.as_tensor(value).to(device, copy=True) for key, value in obs.items()}
            out = {key: value.to(self.obs_dtype[key]) for key, value in x.items()}
            if isinstance(obs_rms, DictRunningMeanStd):
                for key, rms in obs_rms.stats.items():
                    out[key] = self._normalized(rms, x[key], obs[key], update_stats, stale, returned_at, reset, key)
            return out
        whole = torch.as_tensor(obs).to(device, copy=True)
        if obs_rms is None:
            assert not isinstance(self.obs_dtype, dict)
            return whole.to(self.obs_dtype)
        assert isinstance(obs_rms, RunningMeanStd)
        return self._normalized(obs_rms, whole, obs, update_stats, stale, returned_at, reset)

    def _normalized(
        self,
        obs_rms: RunningMeanStd,
        x: Tensor,
        obs: np.ndarray,
        update_stats: bool,
        stale: np.ndarray | None,
        returned_at: int | None,
        reset: bool,
        key: str | None = None,
    ) -> Tensor:
        """``x`` (``obs`` on the device; a Dict's ``key``) normalised by ``obs_rms``, which takes it first with
        ``update_stats`` (all but the ``stale`` envs'; see :meth:`prepare_obs`)."""
        device = self.device
        if update_stats:
            kept = obs_rms.mean, obs_rms.var, obs_rms.count  # (update() makes new tensors: these stay as they are)
            if stale is not None and stale.any():
                if not stale.all():
                    obs_rms.update(x[torch.as_tensor(~stale, device=device)])
            else:
                obs_rms.update(x)
            # Values beyond about 1e154 overflow the variance's float64 squares: the statistics would be inf for
            # good, and that feature normalised to 0 (finite: no later check would see it). (Inf or NaN in the
            # variance alone: a mean that overflowed makes it so too. One number read back a step: a microsecond
            # or two on the CPU; on CUDA the policy's actions read back anyway.)
            if not math.isfinite(obs_rms.var.max().item()):
                overflowed = ~torch.isfinite(obs_rms.var).reshape(-1).cpu().numpy()
                obs_rms.mean, obs_rms.var, obs_rms.count = kept  # (the statistics as they were, not spoiled)
                self._raise_overflowed(obs, overflowed, stale, returned_at, reset, key)
        return obs_rms.normalize(x)

    def _raise_overflowed(
        self,
        obs: np.ndarray,
        overflowed: np.ndarray,
        stale: np.ndarray | None,
        returned_at: int | None,
        reset: bool,
        key: str | None = None,
    ) -> None:
        """Raise UnusableEnvOutputError naming the env whose observation in ``obs`` (the batch the --norm-obs
        statistics took, but the ``stale`` envs'; a Dict's ``key``'s) has the largest magnitude in the features
        whose running variance overflowed float64 (``overflowed``, a mask over the flattened features), and that
        value."""
        rows = np.abs(np.asarray(obs, dtype=np.float64).reshape(len(obs), -1))[:, overflowed]
        if stale is not None:
            rows[stale] = -1.0  # (not taken by the statistics)
        env, feature = np.unravel_index(int(np.argmax(rows)), rows.shape)
        index = int(np.flatnonzero(overflowed)[feature])
        value = np.asarray(obs[env], dtype=np.float64).reshape(-1)[index]
        when = "" if returned_at is None else _returned_when(returned_at, reset)
        named, space = "observation", self.obs_space
        if key is not None:
            assert isinstance(self.obs_space, gym.spaces.Dict)
            named, space = f"observation[{key!r}]", self.obs_space[key]
        raise UnusableEnvOutputError(
            f"{self.server_of(int(env))}{named} of env {env} has a value too large for --norm-obs ({value:.6g} at "
            f"index {index} of the flattened observation; observation space {space}){when}: the running "
            "variance of that feature overflowed float64 (magnitudes beyond about 1e154 cannot be normalised); scale "
            "them on the env servers (a wrapper); the policy cannot act on it"
        )

    @contextlib.contextmanager
    def acting_on(self, raw: RawObs, envs_of: Sequence[int], check_first: bool = False) -> Iterator[None]:
        """Turn an error of the policy's forward on the observations ``raw`` (as the envs gave them,
        of envs ``envs_of``) that one of them explains (NaN, or outside its Discrete space: torch's
        own errors say neither which env nor what came) into an UnusableEnvOutputError naming the env,
        its server, the value and the space; looked for only then on the CPU, and before the forward
        on other devices (:func:`learner.ppo.observations_usable`: CUDA's device-side assert cannot be
        caught and explained) and with ``check_first`` (the value's forward, which raises on no NaN:
        the bootstrap values', else the NaN would reach the update). (The envs' own values: --norm-obs
        statistics updated with a NaN make every env's normalised observation NaN.)"""
        raw = _as_arrays(raw)
        as_float32 = self.obs_rms is None  # (--norm-obs scales float64 observations before the nets see them)
        if (check_first or self.device.type != "cpu") and not observations_usable(
            raw, self.obs_space, as_float32=as_float32
        ):
            raise_unusable(raw, self.obs_space, envs_of, self.server_of, as_float32=as_float32)
        try:
            yield
        except (RuntimeError, ValueError, IndexError) as err:
            raise_unusable(raw, self.obs_space, envs_of, self.server_of, err, as_float32=as_float32)
            raise

    def check_taken(self, obs: Obs, global_step: int) -> None:
        """Raise UnusableEnvOutputError naming the env where an observation the policy took over a rollout
        (``obs``: its storage, (steps, envs, ...), as the nets got them; ``global_step``: the env steps as of
        its end) was not finite. On the CPU, where observations are looked at only once the forward fails
        or at the rollout's end (unless :attr:`looks_first`), an infinite one met mid-rollout (the env's inf,
        or a float64 value beyond float32's range) passes the tanh layers without an error and turns the
        update's gradient NaN, which would be reported as a diverged update. One pass per rollout (float
        observations only). The storage holds the envs' own observations but with --norm-obs, whose
        observations were looked at as they came: there a non-finite one is the normalisation's. (A Dict's: each
        float key's, the first found named.)"""
        if isinstance(obs, dict):
            for key, value in obs.items():
                self._check_taken(value, global_step, f"[{key!r}]")
            return
        self._check_taken(obs, global_step)

    def _check_taken(self, obs: Tensor, global_step: int, key: str = "") -> None:
        """:meth:`check_taken` for one tensor of the rollout's observations (``key``: a Dict's, as "['state']")."""
        if not obs.is_floating_point():
            return
        finite = torch.isfinite(obs.reshape(*obs.shape[:2], -1)).all(dim=2)  # (steps, envs)
        if bool(finite.all()):
            return
        step, env = (int(i) for i in (~finite).nonzero()[0])
        if self.obs_rms is not None:
            # (the envs' own observations were looked at as they came, before the statistics took them:
            # finite, so the normalisation made this one what it is, not the env)
            raise UnusableEnvOutputError(
                f"{self.server_of(env)}observation{key} of env {env} that the policy took at step {step + 1} of the "
                f"rollout ending at env step {global_step:,} was infinite or NaN once normalised (--norm-obs), "
                "though the env gave a finite one: the running mean or variance of the observations overflowed "
                f"float64 (observation space {self.obs_space}; scale such values on the env servers); the policy "
                "cannot act on it"
            )
        raise UnusableEnvOutputError(
            f"{self.server_of(env)}observation{key} of env {env} that the policy took at step {step + 1} of the rollout "
            f"ending at env step {global_step:,} was infinite or NaN as float32: the env gave inf or NaN, or a "
            f"float64 value beyond float32's range (observation space {self.obs_space}; scale such values on the env "
            "servers, or pass --norm-obs); the policy cannot act on it"
        )

    def env_actions(self, raw: Tensor) -> Any:
        return in_bounds(self.agent.head.to_env(raw).cpu().numpy(), self.action_space)

    def act(
        self,
        obs: Obs,
        storage: Rollout,
        step: int,
        envs_slice: slice,
        send: Callable[[Any], None] | None = None,
        *,
        raw_obs: RawObs,
        num_envs: int,
    ) -> Any:
        """The policy's actions for the envs in ``envs_slice``, stored in the rollout at ``step``.

        With ``send``, they go to the envs (``send(actions)``) before their log-probs and values are
        computed, so the envs step meanwhile (the same numbers: sampling is the only RNG use).
        ``raw_obs``: the ``num_envs`` envs' observations as they gave them (``obs`` before
        :meth:`prepare_obs`), what an error of the policy's is explained by.
        """
        with torch.no_grad():
            # (every env's observations: with --norm-obs, one env's NaN makes every env's NaN)
            with self.acting_on(raw_obs, range(num_envs)):
                action, rest = self.actor.sample(obs_map(lambda part: part[envs_slice], obs))
            actions = self.env_actions(action)
            if send is not None:
                send(actions)
            logprob, value = rest()
        storage.actions[step, envs_slice] = action
        storage.logprobs[step, envs_slice] = logprob
        storage.values[step, envs_slice] = value
        return actions

    def value_final(self, storage: Rollout, step: int, truncated: np.ndarray, infos: dict[str, Any]) -> None:
        """Under same-step autoreset, the values of the last observations of the episodes truncated at ``step``
        (``truncated``: per env), stored in the rollout's ``final_values``, which bootstrap them."""
        # The step's observations already hold the next episodes' first ones; the truncated episodes' last
        # ones are in infos["final_obs"].
        idx = np.flatnonzero(truncated)
        final: RawObs
        if isinstance(self.obs_space, gym.spaces.Dict):  # (each a dict of the key's observation)
            final = {key: np.stack([infos["final_obs"][i][key] for i in idx]) for key in self.obs_space.spaces}
        else:
            final = np.stack([infos["final_obs"][i] for i in idx])
        with torch.no_grad(), self.acting_on(final, idx.tolist(), check_first=True):
            final_obs = self.prepare_obs(final, update_stats=False)
            storage.final_values[step, idx] = self.actor.get_value(final_obs)


def _as_arrays(obs: Any) -> RawObs:
    """A batch of observations as arrays: one, or a Dict observation's one per key."""
    if isinstance(obs, dict):
        return {key: np.asarray(value) for key, value in obs.items()}
    return np.asarray(obs)


def _num_rows(obs: RawObs) -> int:
    """How many observations the batch ``obs`` holds (a Dict's: each key's batch holds that many)."""
    if isinstance(obs, dict):
        return len(next(iter(obs.values())))
    return len(obs)


@dataclasses.dataclass(eq=False)
class _Episodes:
    """The envs' episodes as the loop follows them: the return and length of each env's episode under way, and
    those that end: the run's count of them, the window of the last :data:`~learner.resume.RECENT` returns and
    lengths (shared with the checkpoints and the metrics), and the step at which the window's mean first reaches
    ``threshold`` (``counters.solved_at_step``). An episode cut short by a failure counts in none of them."""

    counters: Counters
    recorder: Recorder
    recent_returns: deque[float]
    recent_lengths: deque[int]
    threshold: float | None
    start_time: float
    """time.perf_counter() at the start of the run (its earlier sessions' seconds included): solved_at_seconds'."""
    server_of: Callable[[int], str]
    in_process: bool
    """The envs run here (--backend gym), not on env servers: for an error's words."""
    live: np.ndarray
    """Per env, whether an episode is under way (a reset gave its first observation, and it has not ended): one
    its env loses, even on its first step, is cut short. (An env out of order, whose resets raise, has none under
    way, so its failed steps cut nothing.)"""
    returns: np.ndarray
    lengths: np.ndarray

    def follow(self, change: FleetChange, out_of_order: np.ndarray) -> int:
        """Follow the fleet's ``change`` (``out_of_order``: its new envs whose reset raised, with no episode under
        way); the number of episodes it cut short."""
        # Episodes under way in envs that did not stay (their server left, or every env started over after a
        # failed step) were cut short, as a lost server's are.
        stayed = np.zeros(change.previous_num_envs, dtype=np.bool_)
        stayed[change.previous_index[change.previous_index >= 0]] = True
        cut = int((self.live & ~stayed).sum())
        self.returns = carry_over(self.returns, change, 0.0)
        self.lengths = carry_over(self.lengths, change, 0)
        self.live = carry_over(self.live, change, True) & ~out_of_order
        return cut

    def step(self, done: np.ndarray, lost: np.ndarray, next_step_autoreset: bool) -> int:
        """Follow a step in which the episodes of envs ``done`` ended and envs ``lost`` gave no transition; the
        number of episodes cut short (under way in a lost env), whose return and length start over."""
        cut = lost & self.live
        # (under next-step autoreset an episode that ended has none under way until its reset;
        # under same-step autoreset, one that ended and was not lost has the next under way)
        self.live = ~lost & (~done if next_step_autoreset else True)
        if not lost.any():
            return 0
        self.returns[lost], self.lengths[lost] = 0.0, 0
        return int(cut.sum())

    def add(self, rewards: np.ndarray, valid: np.ndarray, done: np.ndarray) -> bool:
        """Add a step's ``rewards`` (the envs' own, before any clipping or scaling) to the ``valid`` envs' episodes,
        and count those that ended (``done``); whether one of them solved the run (see :meth:`_solved`)."""
        with np.errstate(over="ignore"):  # (a return beyond float64: named just below, not warned of)
            self.returns += np.where(valid, rewards, 0.0)
        self.lengths += valid
        solved = False
        for i in np.flatnonzero(done & valid):
            self._ended(int(i))
            solved = self._solved() or solved
        return solved

    def _ended(self, env: int) -> None:
        """Count env ``env``'s episode, which ended at this step, and start its next."""
        counters = self.counters
        raise_overflowed_return(
            self.returns,
            env,
            self.server_of,
            when=f" at the run's env step {counters.global_step:,}",
            in_process=self.in_process,
        )
        self.recent_returns.append(float(self.returns[env]))
        self.recent_lengths.append(int(self.lengths[env]))
        counters.episodes += 1
        self.recorder.episode(counters.global_step, self.returns[env], self.lengths[env])
        self.returns[env], self.lengths[env] = 0.0, 0

    def _solved(self) -> bool:
        """Whether the mean of the last :data:`~learner.resume.RECENT` returns reached ``threshold`` just now, for
        the first time in the run: ``counters.solved_at_step`` and the rest set, and said."""
        counters, threshold = self.counters, self.threshold
        if (
            threshold is not None
            and counters.solved_at_step is None
            and len(self.recent_returns) == RECENT
            # (a mean that is no number, of returns of a run of before they were looked at, is none to judge)
            and math.isfinite(recent_mean := mean_of(self.recent_returns))
            and recent_mean >= threshold
        ):
            counters.solved_at_step = counters.global_step
            counters.solved_at_seconds = time.perf_counter() - self.start_time
            counters.solved_threshold = threshold
            log.info(
                "solved at step %d: mean return of the last %d episodes >= %g", counters.global_step, RECENT, threshold
            )
            return True
        return False


@dataclasses.dataclass(eq=False)
class _SinceUpdate:
    """What the loop lost since the last update, which the next update's metrics row reports: env steps that gave
    no transition (an unavailable env's, every one of a rollout no update learns from), episodes cut short and
    env errors. A dropped rollout's counts carry on into the next update's; the run's counters get them at each
    update (see :meth:`add_to`)."""

    env_steps_lost: int = 0
    episodes_cut: int = 0
    env_errors: int = 0
    rollout_from: tuple[int, int] = (0, 0)
    """The run's env step and ``env_steps_lost`` as the rollout under way began (see :meth:`drop_rollout`)."""

    def start_rollout(self, global_step: int) -> None:
        """A rollout begins, at the run's env step ``global_step``."""
        self.rollout_from = (global_step, self.env_steps_lost)

    def drop_rollout(self, global_step: int) -> None:
        """The rollout under way, at ``global_step`` now, is not learned from: every env step of it is lost (in
        global_step, in no batch), its unavailable envs' counted already."""
        rollout_from, lost_before = self.rollout_from
        self.env_steps_lost = lost_before + global_step - rollout_from

    def add_to(self, counters: Counters) -> _SinceUpdate:
        """Add these counts to the run's ``counters``, and start again from none; those added."""
        added = dataclasses.replace(self)
        counters.env_steps_lost += self.env_steps_lost
        counters.episodes_cut += self.episodes_cut
        counters.env_errors += self.env_errors
        self.env_steps_lost = self.episodes_cut = self.env_errors = 0
        return added


@dataclasses.dataclass(eq=False)
class _EmptyRollouts:
    """The rollouts in a row in which no env gave a transition (every env raised, or was unavailable), what the
    envs reported in them, and whether any rollout of this session gave one: the run stops with
    NothingToLearnError at :data:`EMPTY_ROLLOUTS` in a row, or at --total-timesteps having learned nothing."""

    in_process: bool
    """The envs run here (--backend gym), not on env servers: for the error's words."""
    in_a_row: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    """What the envs reported in them: text -> env steps."""
    learned: bool = False
    """Whether any rollout of this session gave a transition."""

    def judge(self, valid_any: bool, *, fleet_down: bool, server_lost: bool, step_failed: bool) -> str:
        """Count the rollout just collected (``valid_any``: whether any env gave a transition in it; ``fleet_down``:
        it stopped with every server down, ``server_lost``: one was lost in it; ``step_failed``: a failed step cut
        it short); why it has nothing to learn from, warned of, or "" where it has (or was cut short)."""
        empty = ""  # why this rollout has nothing to learn from, if it has not
        if fleet_down:
            # Every server down with no transition in this rollout: empty, as below, if a server
            # was lost in it (one that answers gRPC but fails every step is "back" at once and
            # lost again, without end); not while the fleet only stays down (an outage, which
            # --give-up-after bounds).
            if not valid_any and server_lost:
                empty = "no env gave a transition in this rollout before every server was lost"
        elif not step_failed and not valid_any:
            empty = "no env gave a transition in this rollout (update skipped)"
        if empty:
            self.in_a_row += 1
            if self.in_a_row >= EMPTY_ROLLOUTS:
                raise NothingToLearnError(nothing_to_learn(self.in_a_row, self.errors, self.in_process))
            # (every server down, the fleet's warning says how long it waits for one: --give-up-after
            # ends the run, not this count, unless servers come back and are lost again each time)
            stops = (
                f"should the servers come back and be lost again before a transition, {EMPTY_ROLLOUTS} such "
                "rollouts in a row stop the run"
                if fleet_down
                else f"the run stops after {EMPTY_ROLLOUTS} such rollouts in a row"
            )
            log.warning("%s: nothing to learn from (%s)", empty, stops)
        elif valid_any:
            self.in_a_row = 0
            self.errors.clear()
        return empty

    def check_learned(self, updates: int, total_timesteps: int) -> None:
        """NothingToLearnError where the run, at --total-timesteps (``total_timesteps``) after ``updates`` updates
        in all its sessions, learned nothing."""
        if self.in_a_row and not self.learned:  # (a budget of fewer than 3 rollouts, all empty)
            raise NothingToLearnError(nothing_to_learn(self.in_a_row, self.errors, self.in_process))
        if not self.learned and updates == 0:
            # Every rollout cut short by a lost server (or the fleet down): no update in the
            # whole run, which is no policy to evaluate, nor a run that did what it was asked.
            raise NothingToLearnError(
                f"the run reached --total-timesteps ({total_timesteps:,}) without an update: every "
                "rollout was cut short by a lost server, or the fleet was down (see the warnings "
                "above); nothing was learned"
            )


def _end_rollout(
    counters: Counters,
    since: _SinceUpdate,
    episodes: _Episodes,
    watch: FleetWatch,
    *,
    rollout_start: float,
    num_envs: int,
    unavailable: np.ndarray,
    learning_rate: float,
    clip_coef: float,
    not_joined: list[str],
) -> dict[str, Any]:
    """End a rollout that an update learns from (begun at ``rollout_start``, time.perf_counter(), of ``num_envs``
    envs; ``unavailable``: per env, whether its last step gave no transition): the run's ``counters`` take
    ``since``'s counts and ``watch``'s fault totals; what the update's metrics row reports of the run (its
    rollout_info)."""
    added = since.add_to(counters)
    # What the update's metrics row reports of the run: as of the end of the rollout it learns from.
    rollout_end = time.perf_counter()
    rollout_info = {
        "global_step": counters.global_step,
        "episodic_return_mean": mean_or_none(list(episodes.recent_returns)),
        "episodic_length_mean": mean_or_none(list(episodes.recent_lengths)),
        "episodes": counters.episodes,
        "episodes_cut": added.episodes_cut,
        "num_envs": num_envs,
        "learning_rate": learning_rate,
        "clip_coef": clip_coef,
        "rollout_seconds": round(rollout_end - rollout_start, 5),
        "ended_at": rollout_end,  # (--overlap-update: the end of the update's period; not in the row)
        "env_steps_lost": added.env_steps_lost,
        "env_errors": added.env_errors,
        "envs_unavailable": int(unavailable.sum()),
        "fleet": watch.rollout_metrics(),
        # (this rollout's: with --overlap-update it is recorded once the next has begun)
        "server_ids": dict(watch.server_ids),
        "replicas_written": None if watch.every_replica else watch.of_note,
        "not_joined": not_joined,
    }
    for key, total in (watch.totals() or {}).items():
        setattr(counters, key, total)
    return rollout_info


def _note_server_versions(config: dict[str, Any], envs: Any, run_dir: Path) -> None:
    """Add to ``config`` (config.json, written again where it changes) what ``envs``' servers say they run."""
    # config.json keeps what every server that served the run said it runs: those that
    # joined, and those that came back as a new process (an upgrade rolled out).
    versions = {**config["server_versions"], **getattr(envs, "server_versions", {})}
    if versions != config["server_versions"]:
        config["server_versions"] = versions
        with writing(run_dir / rundir.CONFIG):
            rundir.write_json(run_dir / rundir.CONFIG, config, run_dir=run_dir)


def _follow_change(
    change: FleetChange,
    *,
    acting: Acting,
    episodes: _Episodes,
    since: _SinceUpdate,
    next_valid: np.ndarray,
    reward_scaler: RewardScaler | None,
    global_step: int,
) -> tuple[Obs, np.ndarray]:
    """Follow the fleet's ``change`` (at the run's env step ``global_step``) in the episodes, the reward scaler
    and ``since``'s episodes cut; the next step's observations (prepared by ``acting``) and, per env, whether
    it is a transition (``next_valid`` as the fleet changed)."""
    # Envs that stayed go on with their episodes; new ones (or all, after a failed
    # step) start from the observations of their reset.
    next_obs = acting.prepare_obs(change.observations, update_stats=False, returned_at=global_step, reset=True)
    # (an env whose reset raised, out of order, starts with no transition nor episode
    # under way, as at the first reset)
    out_of_order = unavailable_envs(change.infos, change.num_envs)
    since.episodes_cut += episodes.follow(change, out_of_order)
    next_valid = carry_over(next_valid, change, True) & ~out_of_order
    if reward_scaler is not None:
        reward_scaler.follow(change)
    return next_obs, next_valid


def _overlapping(
    stack: contextlib.ExitStack,
    agent: Agent,
    seed: int,
    device: torch.device,
    checkpoint: dict[str, Any] | None,
    global_step: int,
) -> tuple[concurrent.futures.ThreadPoolExecutor, torch.Generator, Agent]:
    """--overlap-update: the thread the updates run on (shut down by ``stack``), the generator they shuffle with
    (see :func:`_update_generator`) and the actor, a copy of ``agent``'s nets that collects the rollouts."""
    update_thread = stack.enter_context(
        concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="envfleet-update")
    )
    update_rng = _update_generator(seed, device, checkpoint, global_step)
    actor = copy.deepcopy(agent)
    actor.requires_grad_(False)
    return update_thread, update_rng, actor


def _update_generator(
    seed: int, device: torch.device, checkpoint: dict[str, Any] | None, global_step: int
) -> torch.Generator:
    """--overlap-update: the generator the updates shuffle with, seeded with ``seed``, or as ``checkpoint`` (the
    run resumed, at ``global_step``) saved it."""
    update_rng = torch.Generator(device=device)
    update_rng.manual_seed(seed)
    saved_rng = None if checkpoint is None else checkpoint.get("update_rng")
    if saved_rng is not None and saved_rng.numel() == update_rng.get_state().numel():
        update_rng.set_state(saved_rng)
    elif saved_rng is not None:  # (a CPU generator's state is 5056 bytes, a CUDA one's 16: not the same kind)
        log.info("--overlap-update: the run was saved on another kind of device: its update's shuffling starts anew")
        update_rng.manual_seed(seed + global_step)
    return update_rng


def _finish_update(
    pending: tuple[concurrent.futures.Future[UpdateResult], dict[str, Any], dict[str, Any]],
    recorder: Recorder,
    checkpointer: Checkpointer,
    evaluator: PeriodicEval | None = None,
    video: VideoCapture | None = None,
) -> None:
    """--overlap-update: wait for the update running in the background (``pending``: it, the rollout_info
    of the rollout it learns from, and the state as of that rollout's end), then record it (evaluated first
    where ``evaluator`` says one is due, and its ``video`` recorded: the nets are that update's until the acting
    copy takes them)."""
    future, rollout_info, state = pending
    result = future.result()  # re-raises what the update raised
    # (its period: to the end of its rollout, the steps since being the next rollout's)
    as_of = (rollout_info["ended_at"], rollout_info["global_step"])
    evaluation = _evaluation(evaluator, rollout_info, state, video, checkpointer.counters)
    recorder.record(result, rollout_info, as_of=as_of, evaluation=evaluation)
    checkpointer.finished(state)


def _evaluation(
    evaluator: PeriodicEval | None,
    rollout_info: dict[str, Any],
    state: dict[str, Any] | None = None,
    video: VideoCapture | None = None,
    counters: Counters | None = None,
) -> dict[str, Any] | None:
    """--eval-every: the eval/ columns of the update that learned from the rollout ``rollout_info`` describes,
    evaluated now where one is due there (the nets just updated); None where none is. ``state``: --overlap-update's
    state as of that rollout's end (the run has collected the next rollout since: see PeriodicEval.run).
    --capture-video (``video``): the video of the same nets (and --norm-obs statistics) after the evaluation.

    What a stop (Ctrl-C, SIGTERM, SIGHUP) cut short of them is due at that step (Counters.due: the run's
    ``counters``, and ``state``'s), which the step's checkpoint holds and a --resume does first; so is the run's end
    video, at its last update (--total-timesteps reached) where no evaluation filmed it: the step's checkpoint (the
    run's last) says so as it is written, and the end's write is not one more for it (Checkpointer._on_disk). Nothing
    is due otherwise."""
    step = int(rollout_info["global_step"])
    due: list[str] = []
    evaluation = None
    if evaluator is not None and evaluator.due(step):
        evaluation = evaluator.run(step, state)
        if evaluator.stopped:
            due.append("eval")
        # (none where the evaluation was stopped by a Ctrl-C: VideoCapture.record sees it, and says it is due; one
        # where it was left out, an eval server down or failed, whose warning says so: the video's env is in this
        # process, the evaluation's not)
        if video is not None:
            video.record(step, state)
            if video.stopped:
                due.append("video")
    if video is not None and "video" not in due and video.at_end(step):
        due.append("video")
    if counters is not None:
        counters.due = due
    if state is not None:
        state["counters"]["due"] = list(due)
    return evaluation


def _finish_last_update(
    pending: tuple[concurrent.futures.Future[UpdateResult], dict[str, Any], dict[str, Any]],
    recorder: Recorder,
    checkpointer: Checkpointer,
    on_update: Callable[[dict[str, Any]], object] | None,
    evaluator: PeriodicEval | None = None,
    video: VideoCapture | None = None,
) -> BaseException | None:
    """--overlap-update, at the run's end: wait for the update still running (``pending``, as for
    :func:`_finish_update`), record it and tell ``on_update``; what it raised (the update failed, logged; a
    second Ctrl-C came while waiting for it), or ``on_update`` did, else None."""
    try:
        _finish_update(pending, recorder, checkpointer, evaluator, video)
    except BaseException as err:  # it failed, or a second Ctrl-C came while waiting for it
        if not isinstance(err, KeyboardInterrupt):
            log.error("the update running in the background failed: %s: %s", type(err).__name__, err)
        return err
    try:
        _tell(on_update, recorder)
    except BaseException as err:  # the caller's: the run ends with it, its files written
        return err
    return None


def _filming(video: VideoCapture) -> bool:
    """--capture-video: whether ``video``'s videos are still recorded (none after one failed)."""
    return not video.failed


def _save_best_eval(checkpointer: Checkpointer, state: dict[str, Any] | None, counted: bool = False) -> Path:
    """--eval-every: checkpoints/best-eval.pt of the nets as they are now, those of the best evaluation so far
    (--save-best), with ``state`` (--overlap-update's, as of the end of the rollout the evaluated update learned
    from; a solved run's last update's, ``counted`` already: see PeriodicEval.final) or the run's state as of
    now (a checkpoint as ``learner eval`` reads one, as the step's own)."""
    state = state if state is not None else checkpointer.rollout_state()
    # (the evaluated update's count: it is evaluated before Recorder.record counts it; a copy, as the state
    # goes on to the step's checkpoint, which Checkpointer.finished gives the count)
    counters = {**state["counters"], "update": checkpointer.counters.update + (0 if counted else 1)}
    path = checkpointer.run_dir / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT
    with writing(path, torch_save=True):
        return save_best_checkpoint(
            checkpointer.run_dir, checkpointer.payload({**state, "counters": counters}), rundir.BEST_EVAL_CHECKPOINT
        )


def _write_summary(run_dir: Path, summary: dict[str, Any], propagating: bool) -> bool:
    """Write ``summary`` to ``run_dir``'s summary.json, unless an error on its way out of the run (``propagating``)
    finds the run dir gone; whether it was there. An OSError writing it raises, as the error of a run that
    ends well; where another error ends the run, it is logged (that error follows)."""
    # (a run dir deleted or moved mid-run: the error on its way says so, and nothing is written)
    here = run_dir.is_dir() or not propagating
    try:
        if here:
            rundir.write_json(run_dir / rundir.SUMMARY, summary, run_dir=run_dir)
    except OSError as err:
        if not propagating:
            raise cannot_write(run_dir / rundir.SUMMARY, err) from err
        log.error("%s", cannot_write(run_dir / rundir.SUMMARY, err))  # (the error that stopped it follows)
    return here


@dataclasses.dataclass(eq=False)
class _Updater:
    """The updates of ``agent``'s nets, each on a rollout's batch, recorded (``recorder``), checkpointed when due
    (``checkpointer``) and told to train()'s ``on_update``: at once, or (--overlap-update) on ``thread``, shuffling
    with ``rng``, while ``actor``, a copy of the nets, collects the next rollout."""

    agent: Agent
    actor: Agent
    optimizer: optim.Optimizer
    hp: PPOConfig
    counters: Counters
    start_time: float
    """time.perf_counter() at the start of the run (its earlier sessions' seconds included)."""
    recorder: Recorder
    checkpointer: Checkpointer
    on_update: Callable[[dict[str, Any]], object] | None
    thread: concurrent.futures.ThreadPoolExecutor | None
    rng: torch.Generator | None
    pending: tuple[concurrent.futures.Future[UpdateResult], dict[str, Any], dict[str, Any]] | None = None
    """--overlap-update: the update running in the background (see :func:`_finish_update`)."""
    evaluator: PeriodicEval | None = None
    """--eval-every: evaluates the nets after the updates it is due at, for their rows."""
    video: VideoCapture | None = None
    """--capture-video: a video of the nets at each evaluation, and of those the run ends with."""

    def update(self, batch: Batch, rollout_info: dict[str, Any], *, learning_rate: float, clip_coef: float) -> None:
        """Update the nets on ``batch``, of the rollout ``rollout_info`` describes; with --overlap-update, once the
        update on the previous rollout is done (recorded, told), in the background."""
        agent, checkpointer, recorder = self.agent, self.checkpointer, self.recorder
        if self.thread is None:
            # From here on, a checkpoint of this run would mix two updates (not before: an error
            # found while the batch is made leaves the nets as of the last update, checkpointed).
            checkpointer.updating = True
            result = ppo_update(agent, self.optimizer, batch, self.hp, learning_rate=learning_rate, clip_coef=clip_coef)
            evaluation = _evaluation(self.evaluator, rollout_info, video=self.video, counters=self.counters)
            recorder.record(result, rollout_info, evaluation=evaluation)
            checkpointer.finished(checkpointer.rollout_state())
            _tell(self.on_update, recorder)
            return
        # --overlap-update: wait for the update on the previous rollout, then the acting copy
        # takes its nets and collects the next rollout while this one's update runs.
        if self.pending is not None:
            in_flight, self.pending = self.pending, None
            _finish_update(in_flight, recorder, checkpointer, self.evaluator, self.video)
            _tell(self.on_update, recorder)
            if self.counters.due:
                # A stop cut its evaluation or video short (due at its step): the run stops at that update, as
                # without --overlap-update, the rollout just collected not learned from (as a Ctrl-C in a rollout
                # leaves one), so that its checkpoint is that update's, which --resume evaluates first. (Learning
                # from it too, the run's last checkpoint was of the next update, and that evaluation was lost.)
                return
        self.actor.load_state_dict(agent.state_dict())
        checkpointer.updating = True
        self.counters.seconds = time.perf_counter() - self.start_time  # (as of this rollout's end)
        state = checkpointer.rollout_state()
        # (what is due at its step is its own, said once it is recorded: not the update's before, in the counters)
        state["counters"]["due"] = []
        self.pending = (
            self.thread.submit(
                ppo_update,
                agent,
                self.optimizer,
                batch,
                self.hp,
                learning_rate=learning_rate,
                clip_coef=clip_coef,
                generator=self.rng,
            ),
            rollout_info,
            state,
        )

    def finish(
        self, propagating: bool, *, solved: bool = False, finished: bool = False, stop_reason: str | None = None
    ) -> BaseException | None:
        """At the run's end (``propagating``: an error on its way out of it): --overlap-update's update of the last
        whole rollout, which runs on, counted once done (see :func:`_finish_last_update`); then, for a run stopped
        by --stop-at-return (``solved``), the nets it ends with evaluated (--eval-every: PeriodicEval.final); for
        one solved or ``finished`` (--total-timesteps reached), their video (--capture-video: at its last update's
        step, unless its evaluation made one there); what raised, else None.

        Before that evaluation or video, the run's last checkpoint is written (Checkpointer.end with
        ``stop_reason``, summary.json's), the solve in it, and them as due (Counters.due): they take seconds to
        minutes, and a learner killed meanwhile (SIGKILL: the OOM killer, a pod killed without grace) left a
        checkpoint without the solve, which --resume trained on from; now --resume does what is due, then ends as
        this run would have. train() calls Checkpointer.end again after, which writes it once more only where the
        evaluation changed its counters (eval_return_mean, best_eval_*, and what is still due: the same step's
        file, replaced). That second write stays: without it the checkpoint would not hold the evaluation's
        figures, and would say it is due, for every --resume to play it again; without the first, a kill during
        the evaluation loses the solve. (A video alone does not write it again: its GIF says it is done.)"""
        error = None
        if self.pending is not None:
            in_flight, self.pending = self.pending, None
            # (on_update not while an error is on its way out: the run is over)
            error = _finish_last_update(
                in_flight,
                self.recorder,
                self.checkpointer,
                None if propagating else self.on_update,
                None if propagating else self.evaluator,
                None if propagating else self.video,
            )
        # (this session's last update: none, no nets of its own to show; a resumed session's that redid what its
        # checkpoint said was due: the checkpoint's, see redo_due)
        last_row = self.recorder.last_row
        evaluate = solved and not propagating and self.evaluator is not None
        film = (solved or finished) and not propagating and self.video is not None and bool(last_row)
        if error is None and (evaluate or film) and stop_reason is not None:
            # (what is due at the last update's step, in the checkpoint: a learner killed during it is resumed so)
            due = list(self.counters.due)  # (none: a stop cut nothing short, or the run would not be filmed)
            if evaluate and last_row and "eval/return_mean" not in last_row and "eval" not in due:
                due.append("eval")
            video = self.video
            if (
                film
                and video is not None
                and not video.failed
                and video.last_step != int(last_row["global_step"])
                and "video" not in due
            ):
                due.append("video")
            self._due(due)
            try:  # (the run's last checkpoint first, as train()'s Checkpointer.end would write it now)
                self.counters.seconds = time.perf_counter() - self.start_time
                self.checkpointer.end(stop_reason)
            except BaseException as err:  # (a write that failed: train() tries it again, and raises its error)
                error = err
        if error is None and evaluate and self.evaluator is not None:
            live, counters = self.recorder.live, self.checkpointer.counters
            if live is not None:  # (solved, as the log said: the gauges say so during the evaluation too)
                live.observe_progress(global_step=counters.global_step, solved=counters.solved_at_step is not None)
            try:
                self.evaluator.final(self.checkpointer.last_update)
            except BaseException as err:  # (a second Ctrl-C, a write that failed: the run's files written all the same)
                error = err
            if error is None and not self.evaluator.stopped:
                self._done("eval")
        if error is None and film and self.video is not None and last_row:
            try:
                # (the nets and --norm-obs statistics of its last update, which its last checkpoint holds)
                self.video.record(int(last_row["global_step"]), self.checkpointer.last_update)
            except BaseException as err:  # (a second Ctrl-C: the run's files written all the same)
                error = err
            if error is None and not self.video.stopped:
                self._done("video")
        return error

    def _due(self, due: list[str]) -> None:
        """What is due at the last update's step and not done (Counters.due): in the run's counters and the state
        it ended with (Checkpointer.last_update), for the checkpoint written next."""
        self.counters.due = list(due)
        if self.checkpointer.last_update:
            self.checkpointer.last_update["counters"]["due"] = list(due)

    def _done(self, what: str) -> None:
        """``what`` (``"eval"``, ``"video"``), due at the last update's step, is done: no longer due."""
        self._due([w for w in self.counters.due if w != what])

    def redo_due(self, due: list[str], run_dir: Path) -> None:
        """A resumed session, before its first rollout: what its checkpoint said was due at its step and not done
        (``due``: Counters.due, those this session's options do, resume.owed_work), cut short by a stop or a kill:
        the evaluation (PeriodicEval.redo) and then the video (VideoCapture.record), of the checkpoint's nets and
        --norm-obs statistics (Checkpointer.last_update's, as restored), seeded as they would have been, recorded
        where they would have been: the row of the checkpoint's update (metrics.jsonl's last: the Recorder's
        last_row from here on), TensorBoard, W&B, the bar, summary.json, best-eval.pt, videos/. A stop (Ctrl-C)
        during them leaves what it cut short due, as the checkpoint on disk says.

        The evaluation done, the checkpoint of its step is written again (the same file, replaced), with its figures
        (eval_return_mean, best_eval_*) and no longer due: a stop before this session's first update writes none
        (its step is on disk), and a kill none either, so that checkpoint said the evaluation was due still, and
        each --resume played it again (TensorBoard holding its point once more each time), with best_eval_* older
        than summary.json's. (A video alone writes none: its GIF says it is done.)"""
        state = self.checkpointer.last_update
        step, update = int(state["counters"]["global_step"]), int(state["counters"]["update"])
        row = rundir.last_row(run_dir / rundir.METRICS)
        if row is None or row.get("update") != update or row.get("global_step") != step:
            log.warning(
                "resume: the %s of step %s, cut short in the last session, %s left out: %s has no row of that update",
                owed_said(due),
                f"{step:,}",
                "are" if len(due) > 1 else "is",
                run_dir / rundir.METRICS,
            )
            self._due([])
            return
        self.recorder.last_row = row
        log.info(
            "resume: the %s of step %s, cut short in the last session, first",
            owed_said(due),
            f"{step:,}",
        )
        self._due(due)
        if "eval" in due and self.evaluator is not None:
            self.evaluator.redo(state)
            if self.evaluator.stopped:
                return
            self._done("eval")
            self.checkpointer.save(f"update {update}, its evaluation done", state)
        if "video" in due and self.video is not None:
            self.video.record(step, state)
            if not self.video.stopped:
                self._done("video")


def _say_still_due(due: list[str], step: int, run_dir: Path) -> None:
    """A run that ended done (--total-timesteps reached, --stop-at-return met) whose last update's (at env step
    ``step``) evaluation or video a Ctrl-C (SIGTERM, SIGHUP) cut short (``due``: Counters.due; a video whose GIF is
    there is done): said as a warning, with the command that does it. Its exit status is a finished run's, and its
    lines looked done; only an INFO line said what was left out, which the bar does not show."""
    due = still_due(due, run_dir, step)
    if due:
        log.warning(
            "the %s of step %s, the run's last, %s cut short: learner train --resume %s does %s (and ends there)",
            owed_said(due),
            f"{step:,}",
            "were" if len(due) > 1 else "was",
            run_dir,
            "them" if len(due) > 1 else "it",
        )


_runs_in_process = 0
_runs_lock = threading.Lock()
# What the caller had before the first of the runs under way began (see _counted_run): None while none is.
_callers_settings: tuple[dict[str, Any], bool] | None = None


@contextlib.contextmanager
def _counted_run() -> Iterator[None]:
    """train() under way; a warning where another already is in this process (threads of one process
    share the global generators the runs draw from, so neither draws what its seed alone would give).

    The process-wide settings a run changes (the global generators, cudnn's ``deterministic``) are the
    caller's again once the last run under way ends: each run putting back what it found, two runs in
    threads that overlap (A starts, B starts, A ends, B ends: two seeds in a notebook's thread pool) left
    the process with what A had set (its seeded generators, its --torch-deterministic)."""
    global _runs_in_process, _callers_settings
    with _runs_lock:
        if _runs_in_process == 0:
            _callers_settings = (capture_rng(), torch.backends.cudnn.deterministic)
        _runs_in_process += 1
        others = _runs_in_process - 1
    try:
        if others:
            log.warning(
                "%d other train() run%s in this process: runs in threads of one process share Python's, NumPy's "
                "and torch's global random generators, so none is reproducible from its seed (alone, or each in a "
                "process of its own, they are)",
                others,
                "s" if others > 1 else "",
            )
        yield
    finally:
        with _runs_lock:
            _runs_in_process -= 1
            if _runs_in_process == 0 and _callers_settings is not None:
                rng, deterministic = _callers_settings
                _callers_settings = None
                restore_rng(rng)
                torch.backends.cudnn.deterministic = deterministic


def _tell(on_update: Callable[[dict[str, Any]], object] | None, recorder: Recorder) -> None:
    """train()'s ``on_update``: the update just recorded, as metrics.jsonl has it (a copy: the caller's to keep)."""
    if on_update is not None:
        on_update(copy.deepcopy(recorder.last_row))


def train(
    args: Args,
    *,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    on_fleet_change: Callable[[FleetChange], None] | None = None,
    on_update: Callable[[dict[str, Any]], object] | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Train until ``--total-timesteps`` or ``--stop-at-return``; returns what ``summary.json`` holds, with
    ``run_dir`` and, with --track, ``wandb_run`` (what ``wandb-run.json`` holds: id, project, entity, url).

    Stopped by Ctrl-C (a notebook's kernel interrupt), SIGTERM or SIGHUP, it stops at the next step, writes what
    a finished run writes, then raises :class:`~learner.errors.TrainingInterrupted` with that summary
    (``.summary``): a caller that trains several runs stops there, not at the next run's start. A second
    Ctrl-C aborts at once (KeyboardInterrupt). torch's thread count, cudnn's ``deterministic`` and matplotlib's
    backend are as they were once it returns or raises.

    ``on_start`` is called once the envs are up, with what ``config.json`` holds plus ``run_dir``,
    for a resumed run ``resumed_from`` (the checkpoint) and ``resumed_step`` (with --metrics-port, config.json's
    ``metrics_url``: where the metrics are served, which the CLI prints).
    ``on_fleet_change`` is called with each change of the fleet (servers that joined or left), before
    the rollout that steps the changed fleet; a change of none but every env starting over (after a rollout
    dropped because an env raised, --no-fault-tolerant) only where the warning about that rollout was logged:
    once a minute at most, unless rollouts are dropped in a row (an env that raises every few hundred steps
    would make one every few rollouts).
    ``on_update`` is called after each update (its checkpoint written, if one was due), on the calling
    thread, with a copy of the row metrics.jsonl got (``global_step``, ``episodic_return_mean``, the
    losses, ...): for a sweep's pruning. What it returns is ignored. To end the run there, set ``stop``
    (it stops at its next step, as below); an exception it raises ends the run as an error does (its
    checkpoint and summary.json, ``stop_reason`` ``"error: ..."``, written) and reaches the caller.
    ``stop``, once set (from any thread: a training thread's owner, a notebook's button), stops the run
    as Ctrl-C does (at the next step; checkpoint, summary.json and plot written), but ``train()`` then
    returns its summary, whose ``stop_reason`` is ``"stopped"``.
    """
    if stop is not None and stop.is_set():
        log.warning(
            "stop was set before train() began: the run stops at its first step, having learned nothing "
            "(clear() the Event to use it again)"
        )
    device = pick_device(args.device)
    if device.type == "cuda":  # (summary.json's cuda_max_memory_mb: this run's, not the process's earlier ones')
        torch.cuda.reset_peak_memory_stats(device)
    args, checkpoint_file, checkpoint, unreadable = _checkpoint_to_resume(args)
    given = args.run_dir or args.resume
    given_dir = str(Path(given).absolute()) if given else None
    if given_dir and checkpoint is None:
        _check_fresh(Path(given_dir))  # before starting any servers
    # A resumed run's evaluation or video of its checkpoint's step cut short by a stop or a kill (Counters.due): those
    # this session's options ask for are done first (see _Updater.redo_due); a run done otherwise ends after them.
    owed: list[str] = []
    ended_as: str | None = None
    if checkpoint is not None:
        from_other_versions(checkpoint, checkpoint_file or "")
        owed = owed_work(args, checkpoint["counters"], Path(given_dir or "."))
        ended_as = check_resume(args, checkpoint, owed)

    if args.track:  # (wandb, imported before any server starts: missing, the error names the extra to install)
        from learner.tracking import tracked

    fleet = fleet_spec(args)
    with contextlib.ExitStack() as stack:
        # Seeding (CleanRL): every RNG the learner draws from; env i gets seed + i at reset. The global
        # ones are the caller's again at the end (a random search drawing its next trial's settings from
        # them drew the same ones after each run): _counted_run puts them back, with the settings below.
        stack.enter_context(_counted_run())
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        # (put back at the end, by _counted_run: the caller's process keeps its own setting)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        live: LearnerMetrics | None = None  # --metrics-port: served from here (the env servers' start included)
        if args.metrics_port is not None:
            live = serve_metrics(args.metrics_host, args.metrics_port, env_id=args.env or "", run_dir=given_dir or "")
            stack.callback(live.close, args.metrics_linger)  # (entered first: closed last, once the run is over)
        locked = False
        if given_dir and Path(given_dir).is_dir():  # (before any server starts; a new one once it is made)
            _lock_given_dir(stack, given_dir, unreadable, checkpoint_file, checkpoint)
            locked = True
        plotted = stack.enter_context(plot_at_exit(args.plot))  # entered first: plots after the envs close
        envs = stack.enter_context(open_fleet(fleet))
        # Running servers say what they host; --env names what this command starts.
        env_id = str(getattr(envs, "env_id", None) or args.env)
        given_env = args.env  # (the command line's, or a resumed run's: a --servers run's is theirs from here on)
        if args.servers is not None:
            args = _args_for_served_env(args, envs, env_id)
        eval_envs, eval_spec = None, None
        if args.eval_every:  # (before the run dir: eval envs of another env or other spaces are refused)
            eval_spec = eval_fleet(args, fleet, env_id)
            eval_envs = stack.enter_context(open_eval_envs(eval_spec, env_id, envs, args.servers))
        # (before the run dir too: an env or renderer missing here is refused, not found at the first video)
        video_spec = VideoCapture.check(args, envs, env_id, given_env) if args.capture_video else None
        # Before the run dir: a refused env leaves none. (A resumed run has its network, however large.)
        check_trainable(envs.single_observation_space, envs.single_action_space, cnn_size=checkpoint is None)
        served = _served(args, envs)
        wrappers = served["wrappers"]
        raw = raw_atari_frames(env_id, wrappers, envs.single_observation_space)
        if raw:
            log.warning("%s", raw)
        hp = resolve_ppo(args, envs.single_observation_space, envs.single_action_space)
        _check_squash(hp, envs, wrappers)
        obs_shape, obs_dtype = _obs_storage(envs.single_observation_space)
        _check_rollout_memory(hp, envs.num_envs, obs_shape, obs_dtype, device, overlap=args.overlap_update)
        autoreset = _autoreset_mode(envs)
        run_dir = _make_run_dir(stack, given_dir, env_id, fresh=checkpoint is None, locked=locked)
        if args.capture_video:  # (a videos/ that is a file: said now, not as each video's "File exists")
            check_videos_folder(run_dir)
        next_step_autoreset = autoreset is gym.vector.AutoresetMode.NEXT_STEP
        obs_space, action_space = envs.single_observation_space, envs.single_action_space
        if checkpoint is not None:
            _check_resumed_envs(args, checkpoint, envs, fleet)
        _check_minibatches(hp, envs.num_envs)
        image = is_image_space(obs_space)
        # (restored at the end: the caller's process, a notebook's kernel, keeps its own setting)
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        set_torch_threads(device, image or bool(image_keys(obs_space)), args.torch_threads)
        _warn_of_settings(args, hp, device, obs_space, action_space, image)

        agent = Agent(obs_space, action_space, hidden_sizes=hp.hidden_sizes, action_bounds=hp.action_bounds).to(device)
        # eps 1e-5, not torch's 1e-8: PPO's baselines (Huang et al., 2022, detail 3). fused: one kernel for every
        # parameter's update (on CPU since torch 2.4, pyproject's floor).
        optimizer = optim.Adam(agent.parameters(), lr=hp.learning_rate, eps=1e-5, fused=True)
        vector_obs = (isinstance(obs_space, gym.spaces.Box) and not image) or bool(vector_keys(obs_space))
        obs_rms = obs_normalizer(obs_space, vector_keys(obs_space), device) if hp.norm_obs and vector_obs else None
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
                file=checkpoint_file,
            )
            counters.due = list(owed)  # (what it left out is no longer due: the session runs without its option)
        threshold = args.stop_at_return if args.stop_at_return is not None else reward_threshold(env_id)
        threshold = resumed_threshold(counters, threshold)

        config = _run_config(
            args,
            hp,
            envs,
            env_id=env_id,
            fleet=fleet,
            served=served,
            autoreset=autoreset,
            device=device,
            image=image,
            threshold=threshold,
            run_dir=run_dir,
            resumed_at_step=counters.global_step if checkpoint is not None else None,
        )
        if live is not None:  # (where this session serves its metrics: --metrics-port 0's port, for a script)
            config["metrics_url"] = live.url
        with writing(run_dir / rundir.CONFIG):
            rundir.write_json(run_dir / rundir.CONFIG, config, run_dir=run_dir)
        servers = len(config["envs"]["addresses"])
        if not (every := every_replica(args.replica_metrics, servers)) and on_start is None:
            log.info("%s", replica_metrics_note(servers))  # (the command prints it with the run's first lines)
        _say_started(
            config,
            hp,
            fleet,
            envs,
            env_id=env_id,
            device=device,
            run_dir=run_dir,
            counters=counters,
            live=live,
            on_start=on_start,
            resumed_from=str(checkpoint_file) if checkpoint else None,
        )
        tracker: WandbRun | None = None  # --track: the W&B run (finished once the loop is over)
        if args.track:
            tracker = stack.enter_context(tracked(run_dir, config, args))
        writer = None
        faults_seen: set[str] = set()  # (TensorBoard's faults/ tags so far: see write_tensorboard)
        if args.tensorboard:
            writer, faults_seen = _events_writer(
                stack, run_dir, config, resumed_at_step=counters.global_step if checkpoint is not None else None
            )
        with writing(run_dir / rundir.METRICS):
            metrics_file = open(run_dir / rundir.METRICS, "a")  # noqa: SIM115 (closed by the stack)
        # Each row is flushed as written: a close can only fail on a row whose write failed (and said so).
        stack.callback(_close_quietly, metrics_file)
        show_progress = args.progress if args.progress is not None else bar_by_default()
        bar = stack.enter_context(progress_bar(show_progress, hp.total_timesteps, counters.global_step))
        # No terminal (a container's or a job's log, a pipe): a line now and then says how the run goes.
        progress_lines = args.progress is None and bar is None
        # (before the first reset: a Ctrl-C raised in an in-process env's reset would be taken for its error)
        stop_request = stack.enter_context(StopRequest(logger=log, event=stop))
        recent_returns: deque[float] = deque(counters.recent_returns, maxlen=RECENT)
        recent_lengths: deque[int] = deque(counters.recent_lengths, maxlen=RECENT)

        # --overlap-update: the nets are updated on a background thread while a copy of them (the actor)
        # collects the next rollout; each update shuffles with its own generator, so that a run is
        # the same whatever the threads' timing.
        update_thread: concurrent.futures.ThreadPoolExecutor | None = None
        update_rng: torch.Generator | None = None
        actor = agent
        if args.overlap_update:
            update_thread, update_rng, actor = _overlapping(
                stack, agent, args.seed, device, checkpoint, counters.global_step
            )

        acting = Acting(
            agent=agent,
            actor=actor,
            obs_space=obs_space,
            action_space=action_space,
            obs_rms=obs_rms,
            obs_dtype=obs_dtype,
            device=device,
            server_of=functools.partial(env_server_of, envs),
        )
        checkpointer = Checkpointer(
            run_dir,
            args=args,
            hp=hp,
            obs_space=obs_space,
            action_space=action_space,
            served=served,
            agent=agent,
            optimizer=optimizer,
            counters=counters,
            recent_returns=recent_returns,
            recent_lengths=recent_lengths,
            obs_rms=obs_rms,
            reward_scaler=reward_scaler,
            update_rng=update_rng,
            resumed=checkpoint is not None,
            write=save_checkpoint,  # (this module's: a test fills the disk through it)
            logger=log,
            metrics=metrics_file,
            versions=config["versions"],
        )

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
        next_obs = acting.prepare_obs(
            obs_np, update_stats=checkpoint is None, stale=lost_np, returned_at=counters.global_step, reset=True
        )
        stepping = _stepping(envs)
        # The fleet counts its faults since it was made; a resumed run's totals add the checkpoint's.
        watch = FleetWatch(
            envs,
            carried={key: getattr(counters, key) for key in FAULT_COUNTS},
            local=args.servers is None,
            every_replica=every,
        )
        next_valid = ~lost_np
        rollout: Rollout | None = None
        stop_reason: str | None = None
        # Env servers that join or leave (docker compose up --scale, a replica that stops) are
        # followed between rollouts: RemoteVectorEnv.refresh looks --servers up again.
        refresh = getattr(envs, "refresh", None)
        drops = _Drops()
        since = _SinceUpdate()  # since the last update (a dropped rollout's counts on)
        errors_said = LogBudget(ENV_ERROR_LOG_S)  # (an env's error logged a minute at most)
        empties = _EmptyRollouts(in_process=args.backend == "gym")
        checkpointer.last_update = checkpointer.rollout_state()  # as of the last update's end (here: the start)
        propagating = False  # an exception is on its way out of the loop
        recorder = Recorder(
            run_dir,
            counters=counters,
            total_timesteps=hp.total_timesteps,
            metrics_file=metrics_file,
            writer=writer,
            faults_seen=faults_seen,
            tracker=tracker,
            live=live,
            bar=bar,
            progress_lines=progress_lines,
            line_every=PROGRESS_LINE_S,  # (this module's: a test prints a line at every update)
            start_time=start_time,
            session_start=session_start,
            session_start_step=session_start_step,
        )
        episodes = _Episodes(
            counters=counters,
            recorder=recorder,
            recent_returns=recent_returns,
            recent_lengths=recent_lengths,
            threshold=threshold,
            start_time=start_time,
            server_of=acting.server_of,
            in_process=args.backend == "gym",
            live=~lost_np,
            returns=np.zeros(num_envs, dtype=np.float64),
            lengths=np.zeros(num_envs, dtype=np.int64),
        )
        updater = _Updater(
            agent=agent,
            actor=actor,
            optimizer=optimizer,
            hp=hp,
            counters=counters,
            start_time=start_time,
            recorder=recorder,
            checkpointer=checkpointer,
            on_update=on_update,
            thread=update_thread,
            rng=update_rng,
        )
        if eval_envs is not None and eval_spec is not None:
            updater.evaluator = PeriodicEval(
                args=args,
                envs=eval_envs,
                fleet=eval_spec,
                agent=agent,
                obs_rms=obs_rms,
                device=device,
                stop=stop_request,
                counters=counters,
                total_timesteps=hp.total_timesteps,
                last_step=counters.global_step,
                save_best=functools.partial(_save_best_eval, checkpointer) if args.save_best else None,
                shown=recorder,
            )
        if video_spec is not None:
            updater.video = VideoCapture(
                run_dir=run_dir,
                spec=video_spec,
                spaces=(str(obs_space), str(action_space)),
                agent=agent,
                obs_rms=obs_rms,
                envs=envs,
                device=device,
                stop=stop_request,
                seed=args.seed,
                tracker=tracker,
                shown=recorder,
                total_timesteps=hp.total_timesteps,
            )
            if updater.evaluator is not None:  # (its warnings of evaluations left out say the videos go on, or not)
                updater.evaluator.filming = functools.partial(_filming, updater.video)

        try:
            if owed:  # (resumed: what its checkpoint's step was due and not done, first)
                updater.redo_due(owed, run_dir)
                # (the first update's period starts after it: its sps_update, other_seconds and transitions_per_s
                # are its own, as an uninterrupted run's, not the redo's seconds too; sps stays the session's)
                recorder.last_record = (time.perf_counter(), recorder.last_record[1])
                if stop_request.requested:
                    stop_reason = _asked_stop(stop_request)
                elif ended_as == "stop_at_return":  # (solved before: it ends as it would have, its summary complete)
                    stop_reason = ended_as
            while stop_reason is None:
                if counters.global_step >= hp.total_timesteps:
                    empties.check_learned(counters.update, hp.total_timesteps)
                    # The steps of rollouts dropped since the last update are the run's too.
                    since.add_to(counters)
                    stop_reason = "total_timesteps"
                    break
                if stop_request.requested:  # Ctrl-C during the update: stop before the next rollout
                    stop_reason = _asked_stop(stop_request)
                    break
                # ---- follow the fleet: servers that joined or left since the last rollout ------------------
                if refresh is not None:
                    drop, unsaid = drops.to_follow()
                    change = refresh(drop=drop)
                    _note_server_versions(config, envs, run_dir)
                    if change is not None:
                        # (every env starting over, and nothing else, goes with its dropped rollout's line)
                        if on_fleet_change is not None and not (unsaid and not change.added and not change.removed):
                            on_fleet_change(change)
                        raw_obs = change.observations
                        next_obs, next_valid = _follow_change(
                            change,
                            acting=acting,
                            episodes=episodes,
                            since=since,
                            next_valid=next_valid,
                            reward_scaler=reward_scaler,
                            global_step=counters.global_step,
                        )
                        # (the groups follow the servers: one per server at most, so a fleet that started
                        # without some of them pipelines once they join)
                        stepping = _stepping(envs)
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
                since.start_rollout(counters.global_step)
                fleet_down = False
                lost_before = watch.servers_lost()
                watch.start_rollout()  # (the servers' statistics are the rollout's: not the update's before it)
                for step in range(hp.num_steps):
                    obs_put(rollout.obs, step, next_obs)
                    try:
                        obs_np, reward_np, term_np, trunc_np, infos = _step_envs(
                            envs, stepping, acting, next_obs, rollout, step, raw_obs=raw_obs, num_envs=num_envs
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
                        # (fault-tolerant, a step raises only once every server is gone: nothing to wait for)
                        if not drops.failed(
                            err,
                            counters,
                            since,
                            num_envs=num_envs,
                            stop=stop_request,
                            can_drop=refresh is not None and not args.fault_tolerant,
                        ):
                            raise
                        break
                    counters.global_step += num_envs
                    done_np = np.logical_or(term_np, trunc_np)
                    # A step is a transition of env i unless it follows an episode's end (next-step
                    # autoreset) or env i was unavailable in it (its server lost or down, rejoining, or
                    # its env raised): then its action was not applied, or its result is lost.
                    lost_np = unavailable_envs(infos, num_envs)
                    valid = next_valid & ~lost_np
                    rollout.valid[step] = valid
                    since.env_steps_lost += int(lost_np.sum())
                    # Episodes cut short by a failure do not count as episodes in the returns.
                    since.episodes_cut += episodes.step(done_np, lost_np, next_step_autoreset)
                    if lost_np.any():
                        since.env_errors += _count_env_errors(
                            infos, envs, empties.errors, errors_said, counters.env_errors + since.env_errors
                        )
                        if lost_np.all() and refresh is not None and not np.any(getattr(envs, "available", True)):
                            # Fault-tolerant, every server is down (each step now waits up to a second for
                            # one): look the servers up again now, not after the rest of the rollout, so
                            # replicas that replaced them (compose down and up, say) join at once.
                            fleet_down = True
                            # (no update comes while it lasts: the bar, or a line at their period, says so)
                            recorder.fleet_down(
                                len(getattr(envs, "addresses", ())),
                                len(getattr(envs, "servers_not_joined", ())),
                                num_envs,
                            )
                            break
                    if recorder.outage is not None:  # (a server is up again: the bar shows its figures again)
                        recorder.fleet_up(*_servers_up(envs, watch))

                    # (one NaN spreads through the advantages into the nets, and the next step's sampling fails
                    # with torch's "probability tensor contains ... nan")
                    # (and one beyond float32's range, which PPO learns in, unless clipped or scaled into it first)
                    raise_unusable_rewards(
                        reward_np,
                        valid,
                        acting.server_of,
                        "PPO cannot learn from a NaN or infinite reward",
                        when=_returned_when(counters.global_step),
                        float32="" if hp.clip_reward or hp.norm_reward else "--clip-reward or --norm-reward",
                    )
                    # Episode statistics, from the envs' own rewards (before any clipping or scaling).
                    if episodes.add(reward_np, valid, done_np) and args.stop_at_return is not None:
                        stop_reason = "stop_at_return"

                    rollout.rewards[step] = reward_np
                    rollout.terminations[step] = term_np
                    rollout.truncations[step] = trunc_np
                    raw_obs = obs_np
                    next_obs = acting.prepare_obs(
                        obs_np, update_stats=True, stale=lost_np, returned_at=counters.global_step
                    )
                    if not next_step_autoreset and (trunc_np & valid).any():
                        acting.value_final(rollout, step, trunc_np & valid, infos)
                    # Under next-step autoreset, an env whose episode just ended is reset by its next step.
                    next_valid = ~done_np if next_step_autoreset else np.ones(num_envs, dtype=bool)

                    if stop_request.requested:
                        stop_reason = _asked_stop(stop_request)
                    if stop_reason is not None:
                        break
                if stop_reason is not None:
                    break  # a partial rollout is not learned from
                valid_any = bool(rollout.valid[: step + 1].any())
                if not fleet_down and drops.lost is None:  # (a rollout no failure cut short ends a row of them)
                    drops.in_a_row = 0
                empty = empties.judge(
                    valid_any,
                    fleet_down=fleet_down,
                    server_lost=fleet_down and not valid_any and watch.servers_lost() > lost_before,
                    step_failed=drops.lost is not None,
                )
                if drops.lost is not None or fleet_down or empty:
                    # A partial rollout, or one without a transition, is not learned from.
                    since.drop_rollout(counters.global_step)
                    continue
                empties.learned = empties.learned or valid_any

                # ---- the batch: GAE over valid transitions, truncations bootstrapped, flattened --------------
                rollout_info = _end_rollout(
                    counters,
                    since,
                    episodes,
                    watch,
                    rollout_start=rollout_start,
                    num_envs=num_envs,
                    unavailable=lost_np,
                    learning_rate=lr,
                    clip_coef=clip_coef,
                    not_joined=list(getattr(envs, "servers_not_joined", [])),
                )
                with torch.no_grad(), acting.acting_on(raw_obs, range(num_envs), check_first=True):
                    next_value = actor.get_value(next_obs)
                acting.check_taken(rollout.obs, counters.global_step)
                batch = make_batch(
                    rollout,
                    next_value,
                    hp,
                    reward_scaler,
                    next_step_autoreset=next_step_autoreset,
                )
                if reward_scaler is not None:
                    check_reward_scaler(reward_scaler, rollout, acting.server_of, counters.global_step)

                # ---- optimise the policy and value network ---------------------------------------------------
                updater.update(batch, rollout_info, learning_rate=lr, clip_coef=clip_coef)
                # Let go of it (with --overlap-update its update holds it while it runs): held through the next
                # rollout it would be a third copy of the observations when the next batch is made, beside the
                # rollout's and that batch's, which _check_rollout_memory counts.
                del batch
        except BaseException as err:
            stop_reason = _stop_reason(err)
            propagating = True
            raise
        finally:
            # (a solved run's last nets evaluated: not one stopped by Ctrl-C or SIGTERM, whose user wants out)
            update_error = updater.finish(
                propagating,
                solved=stop_reason == "stop_at_return" and not stop_request.requested,
                finished=stop_reason == "total_timesteps" and not stop_request.requested,
                stop_reason=stop_reason,
            )
            if update_error is not None and not propagating:
                stop_reason = _stop_reason(update_error)
            counters.seconds = time.perf_counter() - start_time
            counters = checkpointer.end(stop_reason)  # (the last checkpoint written, if one is due)
            if stop_reason in ("total_timesteps", "stop_at_return"):
                _say_still_due(counters.due, int(checkpointer.last_update["counters"]["global_step"]), run_dir)
            # Fault counts: the whole run's, the checkpoint's and this session's to its very end (the
            # failure that stopped it included).
            summary = build_summary(
                counters,
                stop_reason=stop_reason,
                threshold=threshold,
                last_row=recorder.last_row,
                device=device,
                faults=watch.totals(),
                replicas=watch.replicas,
            )
            # --capture-video: the run's GIFs, its earlier sessions' too; a session without it lists those the run
            # has all the same (its record: they stay in videos/), as summary.json is replaced by each session's.
            videos = listed_videos(run_dir, updater.video.recorded if updater.video is not None else ())
            if videos or updater.video is not None:
                summary["videos"] = videos
            recorder.run_ended(stop_reason, propagating=propagating)  # (TensorBoard: an outage it ended in)
            if bar is not None:
                close_bar(
                    bar,
                    summary,
                    stop_reason,
                    since=(session_start, session_start_step),
                    fleet=recorder.fleet_said(),
                    evaluation=counters.eval_return_mean,
                )
            if live is not None:  # (the steps of a last rollout no update recorded; a solve within it)
                live.run_ended(
                    global_step=counters.global_step,
                    solved=counters.solved_at_step is not None,
                    # (a Ctrl-C during the last update: the run ended as finished, and the command stops as
                    # interrupted, serving on no longer)
                    stop_reason="interrupted" if stop_request.signalled else stop_reason,
                )
            here = _write_summary(run_dir, summary, propagating)
            if tracker is not None:  # (put into the W&B run's summary as it finishes)
                tracker.summary = summary
            if counters.update > 0 and here:
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
