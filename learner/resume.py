"""Going on from an earlier run: the options it recorded (--resume, --like), its counters, its checkpoint restored."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from torch import optim

from learner import rundir
from learner.checkpoint import UnreadableCheckpointError, load_checkpoint, load_nets, missing_checkpoint, restore_rng
from learner.config import (
    DEFAULT_ENV,
    LOCAL_SERVER_OPTIONS,
    NO_TLS,
    SESSION_OPTIONS,
    Args,
    check_served_env_here,
    type_error,
    wrappers_option,
)
from learner.device import pick_device
from learner.envs import reward_threshold
from learner.errors import RunCompleteError, RunDirWriteError, os_reason
from learner.local import DEFAULT_TRANSPORT
from learner.normalize import DictRunningMeanStd, RewardScaler, RunningMeanStd
from learner.ppo import Agent, is_image_space

__all__ = [
    "RECENT",
    "Counters",
    "check_resume",
    "owed_said",
    "owed_work",
    "still_due",
    "earlier_sessions",
    "like_args",
    "restore",
    "resume_args",
    "set_aside_newer",
    "set_aside_videos_after",
    "resumed_threshold",
]

log = logging.getLogger(__name__)

RECENT = 20
"""Finished episodes that "the recent return" (and --stop-at-return) averages over."""


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
    """The fleet's fault counters (``FaultStats``, see fleetwatch.FAULT_COUNTS), the whole run's as of the end of
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
    eval_return_mean: float | None = None
    """--eval-every: the mean return of the last evaluation (None: none yet)."""
    best_eval_return: float | None = None
    """--eval-every: the highest mean return of an evaluation so far (its nets are checkpoints/best-eval.pt, with
    --save-best)."""
    best_eval_step: int | None = None
    """The step of the update that evaluation ran at (None: none ran yet)."""
    due: list[str] = field(default_factory=list)
    """What was due at ``global_step`` (the update the checkpoint is of) and is not done yet: ``"eval"``, its
    --eval-every evaluation (or a solved run's final one), ``"video"``, its --capture-video video; cut short by a
    stop (Ctrl-C, SIGTERM, SIGHUP) or, at a run's end, whose last checkpoint is written before them, by a kill.
    A --resume does them first (:func:`owed_work`), with the checkpoint's nets, statistics and the seed they would
    have had. A video is done once its GIF is there (written whole or not at all): a checkpoint that still says one
    is due whose GIF is there (a run's end's, not written again for it alone) owes none. Written only where
    something is due (an older envfleet reads the others without a word); checkpoints from before 2026-12-07 have
    none: nothing is due."""


def resume_args(run_dir: str | Path, /, **overrides: Any) -> Args:
    """The ``Args`` a run in ``run_dir`` was started with, with ``overrides`` and ``resume=run_dir``.

    ``run_dir`` may be a checkpoint file in a run dir's ``checkpoints/`` (``RUN/checkpoints/step-N.pt``): the
    run goes on from that one, in its run dir (``resume`` the file; see train's abandoning of the newer ones)."""
    if not str(run_dir):
        raise ValueError("--resume: expected a value, got an empty string")
    checkpoint_file: Path | None = None
    if missing := missing_checkpoint(Path(run_dir), "--resume"):
        raise FileNotFoundError(missing)
    if Path(run_dir).is_file():
        if Path(run_dir).parent.name != rundir.CHECKPOINTS:
            raise ValueError(
                f"--resume: expected a run dir (the run goes on from its latest checkpoint) or a checkpoint in its "
                f"{rundir.CHECKPOINTS}/ folder, got the file {run_dir}; pass the run dir it belongs to"
            )
        checkpoint_file, run_dir = Path(run_dir), Path(run_dir).parent.parent
    config = Path(run_dir) / rundir.CONFIG
    if not config.is_file():
        raise FileNotFoundError(f"--resume: expected a run dir holding {rundir.CONFIG}, but {config} does not exist")
    recorded = _read_run_config(config, "--resume", {*overrides, *SESSION_OPTIONS})
    # As recorded (checked once the overrides are in: one may mend what this version refuses), with
    # the progress display and the metrics endpoint this session's.
    values = {**recorded["args"], **SESSION_OPTIONS}
    # (its hyperparameters as it resolved them: a preset retuned since does not change a run under way)
    _pin_resolved(values, recorded, overrides)
    saved = Args.from_json(values, check=False)
    if overrides.get("run_dir") not in (None, str(run_dir)):
        raise ValueError(
            f"--run-dir: a resumed run goes on in its own run dir, {run_dir}; --run-dir cannot go with --resume"
        )
    overrides.pop("run_dir", None)
    # The nets go on as they are: options that shape them (or what they act on) cannot change. (Those that
    # did not apply to the run's envs, as a CNN's hidden sizes, are ignored with a warning, as a new run's are.)
    resolved = recorded.get("ppo") or {}
    idle = _idle_options(recorded)
    for name, before in (
        ("env", saved.env),
        ("hidden_sizes", tuple(resolved["hidden_sizes"]) if "hidden_sizes" in resolved else None),
        ("action_bounds", resolved.get("action_bounds")),
    ):
        wanted = overrides.get(name)
        if wanted is not None and before is not None and wanted != before and name not in idle:
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
    resume = str(checkpoint_file or run_dir)
    return _recorded_with(saved, recorded, overrides, run_dir, "resume", resume=resume, run_dir=str(run_dir))


def _read_run_config(config: Path, flag: str, given: Collection[str]) -> dict[str, Any]:
    """A run's config.json (``config``), read for ``flag`` (--resume, --like): ValueError naming the file and the
    option where it is no run's (damaged, or someone else's file) or records an option of the wrong type (edited
    by hand; not one ``given`` here instead), not a traceback from deep in its reading. Its args have the options
    that did not apply to the run as not given (:func:`_as_applied`)."""
    try:
        recorded = rundir.read_json(config)
    except OSError as err:
        raise ValueError(f"{flag}: cannot read {config}: {os_reason(err)}") from None
    except ValueError as err:
        raise ValueError(f"{flag}: {config} is no run's {rundir.CONFIG}: {err}") from None
    if not rundir.is_run_config(recorded):
        raise ValueError(f"{flag}: {config} is no run's {rundir.CONFIG} (it has no 'args' object)")
    for key in ("ppo", "envs"):
        if recorded.get(key) is not None and not isinstance(recorded[key], dict):
            raise ValueError(f"{flag}: {config} is no run's {rundir.CONFIG} (its '{key}' is not an object)")
    recorded["args"] = _as_applied(recorded["args"])
    for name, value in recorded["args"].items():
        if name not in given and (wrong := type_error(name, value)) is not None:
            raise ValueError(
                f"{flag}: {config} records {wrong}; mend it there, or give --{name.replace('_', '-')} here"
            )
    return recorded


def _as_applied(values: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded options (``values``: its config.json's args) with those that did not apply to it as not
    given (their defaults): on --servers, the options of the env servers this command starts (the running
    servers decided) and --transport (their addresses said it); on --backend gym, how env servers are reached
    (--transport, --step-socket) and pipelined (--pipeline-groups). Older versions recorded them: every run's
    --transport, tcp (the default before unix), and some took --wrappers, --num-envs, ... with --servers, or
    --no-step-socket with --backend gym, and ignored them; this version's checks refuse them there, which
    blamed options the user did not give (nor could leave out). Options given here are checked as a new run's."""
    if values.get("servers") is not None:
        return {**values, **LOCAL_SERVER_OPTIONS, "env_kwargs": {}, "transport": DEFAULT_TRANSPORT}
    if values.get("backend") == "gym":
        return {**values, "transport": DEFAULT_TRANSPORT, "step_socket": True, "pipeline_groups": 1}
    return values


def _idle_options(recorded: dict[str, Any]) -> set[str]:
    """The options that did not apply to a run's envs (``recorded``: its config.json), which it ignored with a
    warning: a CNN's hidden sizes (and --norm-obs for images), non-Box actions' bounds, --norm-obs of observations
    neither a Box nor a Dict (a Dict's vector keys take it; one of images alone warned of as ignoring it, the
    checkpoint then without statistics, as the resumed run)."""
    envs = recorded.get("envs") or {}
    policy = recorded.get("policy")
    if policy is None and _images_recorded(envs.get("observation_space")):
        policy = "Nature CNN"  # (what this version builds for them; before 2026-12-02 config.json did not say)
    idle = {"hidden_sizes", "norm_obs"} if policy == "Nature CNN" else set()
    if not str(envs.get("action_space", "Box")).startswith("Box"):
        idle.add("action_bounds")
    if not str(envs.get("observation_space", "Box")).startswith(("Box", "Dict(")):
        idle.add("norm_obs")
    return idle


_UINT8_BOX = re.compile(r"Box\(0, 255, \((\d+(?:, \d+)*),?\), uint8\)")


def _images_recorded(space: Any) -> bool:
    """Whether the observation space a run's config.json records (``space``, gymnasium's str of it) is images
    this version gives the Nature CNN: for runs of versions whose config.json did not say what their policy
    was, whose --hidden-sizes (the preset's, pinned) would otherwise be warned of as ignored by --like and
    --resume, though the user gave none. (Frames that version gave an MLP, 2-d before 8e003e0, are images all
    the same here: --like trains them with the CNN, and --resume refuses their nets naming that version.)"""
    match = _UINT8_BOX.fullmatch(space) if isinstance(space, str) else None
    if match is None:
        return False
    shape = tuple(int(size) for size in match.group(1).split(", "))
    return is_image_space(gym.spaces.Box(0, 255, shape, np.uint8))


def _pin_resolved(values: dict[str, Any], recorded: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Fill ``values`` (a run's recorded options) with the hyperparameters as the run resolved them
    (config.json's ppo) where its options left them to the preset, unless given (``overrides``, a
    preset among them): the same run after an upgrade that retuned a preset, not this version's. (Not
    those that did not apply to its envs: a CNN's hidden sizes, discrete actions' bounds, which would be
    warned of.)"""
    if "preset" in overrides:
        return
    idle = _idle_options(recorded)
    for name, value in (recorded.get("ppo") or {}).items():
        if name != "preset" and name not in idle and values.get(name, 0) is None and name not in overrides:
            values[name] = tuple(value) if isinstance(value, list) else value


def like_args(source: str | Path, /, **overrides: Any) -> Args:
    """The ``Args`` a run was started with, for a new run (``learner train --like``): ``source`` is its run
    dir or its config.json; ``overrides`` (a seed, say) replace what it recorded. The new run has a run
    dir of its own (``run_dir`` among ``overrides``, else the default) and starts from scratch; the
    auth token, never recorded, is this session's.

    A config.json whose args name no env (``"env": null``: edited by hand, or written by another tool;
    every run records the env it trained on) repeats the env its ``envs.env_id`` records, with a warning
    (it trained CartPole-v1, the default, with the other env's hyperparameters, silently); one that does
    not record that either is a ValueError asking for --env, unless the new run is on running servers,
    which say what they serve."""
    path = Path(source)
    if not str(source):
        raise ValueError("--like: expected a value, got an empty string")
    if not path.exists():
        raise FileNotFoundError(f"--like: expected a run dir or its {rundir.CONFIG}, but {path} does not exist")
    config = path / rundir.CONFIG if path.is_dir() else path
    if not config.is_file():
        raise FileNotFoundError(f"--like: expected a run dir holding {rundir.CONFIG}, but {config} does not exist")
    recorded = _read_run_config(config, "--like", {*overrides, *SESSION_OPTIONS, "run_dir", "resume", "auth_token"})
    fresh = {**SESSION_OPTIONS, "run_dir": None, "resume": None, "auth_token": None}
    values = {**recorded["args"], **fresh}
    unnamed = values.get("env") is None  # (null, or no "env" at all: see below, the default is no repeat)
    if unnamed and isinstance(trained_on := (recorded.get("envs") or {}).get("env_id"), str) and trained_on:
        # A config.json whose args name no env (edited by hand, or written by another tool) that still
        # records the env the run trained on (its envs' env_id, as every run's does): that env, whose
        # hyperparameters the run resolved and pinned here, not CartPole-v1 with them.
        values["env"], unnamed = trained_on, False
        if "env" not in overrides:
            log.warning(
                '--like: %s names no env in its args ("env": null); the run trained on %s (its envs\' env_id), '
                "which this run trains on too (give --env to pick another)",
                config,
                trained_on,
            )
    other_env = overrides.get("env", values.get("env")) != values.get("env")
    if other_env:  # (the run's env options were for its env: the new one gets its own, or none)
        values.update(env_kwargs={}, max_episode_steps=None, wrappers="auto")
    if not other_env:
        _pin_resolved(values, recorded, overrides)
    saved = Args.from_json(values, check=False)
    if other_env:  # (nor the options its servers said)
        recorded = {**recorded, "envs": {}}
    args = _recorded_with(saved, recorded, overrides, config.parent, "like")
    if unnamed and "env" not in overrides and args.servers is None:
        # Nor does it say what it trained on: on envs this command starts, Args would take the default env,
        # CartPole-v1, with the hyperparameters another env's run resolved (on running servers, as the run
        # did, the servers say what they serve).
        raise ValueError(
            f'--like: {config} names no env (its args\' "env" is null, and it records no envs.env_id), so the run '
            f"cannot be repeated on envs this command starts (it would be {DEFAULT_ENV}, the default, with the "
            "hyperparameters the run resolved for its own env); give --env with the env it trained on"
        )
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
        # Moving a run onto running servers: the options of the servers it used to start no longer apply, nor
        # in-process envs (--backend gym) or how it reached its own servers (--transport), unless given here.
        moved = {**LOCAL_SERVER_OPTIONS, "backend": "remote", "transport": DEFAULT_TRANSPORT}
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
        same_env = overrides.get("env", saved.env) == saved.env  # (--like with another env: its servers' are moot)
        if served.get("env_kwargs") is None and "env_kwargs" not in overrides and same_env:
            # (a run of an older version, whose servers did not say: same spaces, maybe not the same task)
            limit = not served.get("max_episode_steps") and "max_episode_steps" not in overrides
            log.warning(
                "--%s: the run in %s trained on running env servers (%s), whose env kwargs%s it does not record; "
                "the envs this command starts get env kwargs %s%s: if those servers were started with other kwargs, "
                "give them as --env-kwargs",
                flag,
                run,
                saved.servers,
                " and time limit" if limit else "",
                json.dumps(saved.env_kwargs or {}),
                " and the env's own time limit" if limit else "",
            )
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
        args = dataclasses.replace(saved, **{**moved, **overrides, **fixed})
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
    if "device" not in overrides:
        try:  # (a GPU the run had, which this host has not: said before any server starts, as the train's would be)
            pick_device(args.device)
        except ValueError as err:
            raise ValueError(
                f"{err} (--device {args.device} comes from the run's {rundir.CONFIG}; give --device cpu, or auto, "
                f"to {what} the run in {run} on this host)"
            ) from None
    return args


_MOVE_OPTIONS = ("backend", "num_servers", "num_envs", "envs_per_server")
"""Options that, given with --resume or --like, move a run trained on --servers onto envs this command starts."""
_MOVE_FLAGS = "--backend, --num-servers, --num-envs or --envs-per-server"


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def from_other_versions(checkpoint: dict[str, Any], path: Path | str) -> None:
    """A checkpoint (``path``) written by another version of envfleet, in this version's form (in place):
    the bar a run was solved against, in checkpoints from before it was recorded (their run's
    --stop-at-return, else its env's threshold: else such a solved run was judged again on resume,
    its ``solved_at_step`` rewritten); counters this version does not know (a newer version's) left
    out, with a warning (they were a TypeError)."""
    counters = checkpoint["counters"]
    if counters.get("solved_at_step") is not None and counters.get("solved_threshold") is None:
        saved = checkpoint.get("args") or {}
        bar = saved.get("stop_at_return")
        counters["solved_threshold"] = float(bar) if bar is not None else reward_threshold(saved.get("env") or "")
    known = {f.name for f in dataclasses.fields(Counters)}
    unknown = sorted(set(counters) - known)
    if unknown:
        log.warning(
            "%s: written by a newer version of envfleet: its counters %s are not known here and are left out "
            "(upgrade envfleet to keep them)",
            path,
            ", ".join(unknown),
        )
        for key in unknown:
            del counters[key]


OWED_WORK = {"eval": "--eval-every", "video": "--capture-video"}
"""What a checkpoint's ``due`` may name, with the option that does it."""


def owed_said(due: Collection[str]) -> str:
    """What ``due`` (Counters.due) names, as the log lines say it: "evaluation", "video", "evaluation and the
    video"."""
    return " and the ".join("evaluation" if what == "eval" else "video" for what in due)


def still_due(due: Collection[str], run_dir: Path, step: int) -> list[str]:
    """What ``due`` (Counters.due of the checkpoint at env step ``step``, of the run in ``run_dir``) names that is
    still to do: a video whose GIF is there is done (written whole or not at all)."""
    from learner.capture import video_path  # (here: learner.capture imports this module's Counters)

    return [w for w in due if w in OWED_WORK and not (w == "video" and video_path(run_dir, step).is_file())]


def owed_work(args: Args, counters: dict[str, Any], run_dir: Path) -> list[str]:
    """What a checkpoint's ``counters`` (of the run in ``run_dir``) say is due at its step and not done
    (:attr:`Counters.due`; a video whose GIF is there is done) that this session (``args``) does: an evaluation
    with --eval-every, a video with --capture-video. What it leaves out (a session resumed without the option: the
    user gets what they asked) is said in an INFO line, and is no more due."""
    step = int(counters["global_step"])
    due = still_due(counters.get("due") or (), run_dir, step)
    doing = [what for what in due if (args.eval_every if what == "eval" else args.capture_video)]
    skipped = [what for what in due if what not in doing]
    if skipped:
        log.info(
            "resume: the %s of step %s, cut short in the last session, %s left out: this session runs without %s",
            owed_said(skipped),
            f"{step:,}",
            "are" if len(skipped) > 1 else "is",
            " and ".join(OWED_WORK[what] for what in skipped),
        )
    return doing


def check_resume(args: Args, checkpoint: dict[str, Any], owed: Collection[str] = ()) -> str | None:
    """RunCompleteError when resuming ``checkpoint`` (the run in ``args.resume``) with ``args`` leaves nothing to
    do: its env steps are done, or it was solved under a bar no lower than --stop-at-return. Where it still
    ``owed`` an evaluation or a video of its last step (:func:`owed_work`), cut short by a stop or a kill, the
    session does them and ends there: then how the run ended (``"total_timesteps"``, ``"stop_at_return"``),
    summary.json's ``stop_reason``; None for a run that goes on."""
    counters = checkpoint["counters"]
    done = int(counters["global_step"])
    total = args.total_timesteps or int(checkpoint["ppo"]["total_timesteps"])
    if done >= total:
        if owed:
            return "total_timesteps"
        raise RunCompleteError(
            f"--total-timesteps: the run in {args.resume} already has {done:,} env steps, so {total:,} leaves "
            f"nothing to do; pass more (e.g. --total-timesteps {done + total}) to continue it"
        )
    solved_at, solved_under = counters.get("solved_at_step"), counters.get("solved_threshold")
    stop_at = args.stop_at_return
    if solved_at is not None and solved_under is not None and stop_at is not None and stop_at <= solved_under:
        if owed:
            return "stop_at_return"
        raise RunCompleteError(
            f"--stop-at-return: the run in {args.resume} was solved at step {solved_at:,} (mean return of the "
            f"last {RECENT} episodes >= {solved_under:g}), so --stop-at-return {stop_at:g} leaves nothing to do; "
            "pass --no-stop-at-return to train it on to --total-timesteps, or a higher --stop-at-return"
        )
    return None


def restore(
    checkpoint: dict[str, Any],
    run_dir: Path,
    *,
    agent: Agent,
    optimizer: optim.Optimizer,
    obs_rms: RunningMeanStd | DictRunningMeanStd | None,
    reward_scaler: RewardScaler | None,
    save_best: bool,
    file: Path | None = None,
) -> Counters:
    """The run in ``run_dir`` as of ``checkpoint`` (read from ``file``, which its errors name the writer of:
    :func:`~learner.checkpoint.written_by`): its nets, optimizer, normalisers and RNG states loaded, its run
    dir cleared of what came after the checkpoint; returns its counters."""
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
    load_nets(agent, checkpoint["model"], f"--resume {run_dir}", checkpoint=checkpoint, file=file)
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
        try:
            kept = load_checkpoint(best_file)["counters"] if best_file.is_file() else {}
        except UnreadableCheckpointError as err:
            # (a damaged disk or copy: the step checkpoints, which the run goes on from, may be fine) Set
            # aside, not overwritten, so that what can be saved of it is still there; the bar is then the
            # checkpoint's own, as after a session with --no-save-best.
            (moved,) = rundir.set_aside_unreadable([best_file])
            log.warning(
                "%s; set aside as %s: the run goes on with its checkpoint's best mean return (%s), and writes a "
                "new %s at the next update that beats it",
                err,
                moved.name,
                "none yet"
                if counters.best_return is None
                else f"{counters.best_return:.2f} at step {counters.best_step}",
                rundir.BEST_CHECKPOINT,
            )
            kept = {"best_return": counters.best_return, "best_step": counters.best_step}
        counters.best_return, counters.best_step = kept.get("best_return"), kept.get("best_step")
    # Metrics of updates after the checkpoint were lost with the run (or, resumed from an older checkpoint,
    # are of the timeline it abandons); the resumed run redoes them. (Cut off the file's end, read from
    # there: a long run's file is neither read whole nor written again.)
    metrics_path = run_dir / rundir.METRICS
    if metrics_path.exists():
        with rundir.writing(metrics_path):
            rundir.drop_rows_after(metrics_path, counters.update)
    set_aside_videos_after(run_dir, counters.global_step)
    return counters


def set_aside_videos_after(run_dir: Path, step: int) -> list[Path]:
    """--capture-video's GIFs in ``run_dir``'s videos/ of steps past ``step`` (the checkpoint's a run is resumed
    from), renamed ``step-N.gif.abandoned`` as :func:`set_aside_newer` renames its newer checkpoints, with a
    warning naming them; the new paths. They are of the updates whose metrics rows :func:`restore` drops: a timeline
    the run abandons (resumed from an older checkpoint), or the updates a killed run made after its last checkpoint,
    which the resumed run redoes (and films again). Left there, videos/ and summary.json's ``videos`` listed a
    video of nets no checkpoint nor row of the run is of (a run resumed from step 32 of 48 listed step 48's GIF
    until it got there again, if ever). Whatever the resumed session's options: an earlier one's videos.

    A rename that fails (a read-only videos/ folder) is a warning, and the run goes on: GIFs are no part of what it
    resumes from, and a failure here (after the newer checkpoints were set aside, the rows dropped) refused every
    resume of the run, with --capture-video or without, until the folder was made writable."""
    newer = [p for p in rundir.list_videos(run_dir) if (rundir.video_step(p) or 0) > step]
    if not newer:
        return []
    try:
        moved = rundir.set_aside_abandoned(newer)
    except RunDirWriteError as err:
        log.warning(
            "resume: the run goes on from step %d, but the videos of later steps in %s could not be set aside (%s): "
            "left as they are",
            step,
            run_dir / rundir.VIDEOS,
            err,
        )
        return []
    log.warning(
        "resume: the run goes on from step %d: the videos of later steps in %s (%s) are set aside as %s",
        step,
        run_dir / rundir.VIDEOS,
        ", ".join(p.name for p in newer),
        ", ".join(p.name for p in moved),
    )
    return moved


def set_aside_newer(run_dir: Path, checkpoint_file: Path, checkpoint: dict[str, Any]) -> None:
    """A run resumed from a checkpoint older than its run dir's latest (``checkpoint_file``, given as a
    file) abandons what came after it: the newer checkpoints in ``run_dir`` are renamed *.abandoned, with
    a warning naming them (else pruning deletes the resumed run's checkpoints before them, their step
    numbers being higher, and a later --resume of the run dir goes on from them, not from this run).
    Their metrics rows go as a killed run's do (:func:`restore` drops the rows past the checkpoint); so does a
    best.pt of a step after it, where there are such checkpoints (its nets are of the abandoned run: else the
    resumed run kept its bar and said it as its best, and learner eval of best.pt evaluated them; a run resumed
    from its latest checkpoint keeps a newer best.pt, written before it was killed). Called with the run dir held."""
    step = int(checkpoint["counters"]["global_step"])
    newer = [p for p in rundir.list_checkpoints(run_dir) if (rundir.checkpoint_step(p) or 0) > step]
    # (only where a timeline is abandoned: a run killed after a best.pt newer than its last checkpoint keeps it;
    # best-eval.pt, --eval-every's best evaluation, alike)
    for name, key in ((rundir.BEST_CHECKPOINT, "best_step"), (rundir.BEST_EVAL_CHECKPOINT, "best_eval_step")):
        best = run_dir / rundir.CHECKPOINTS / name
        if not (newer and best.is_file()):
            continue
        try:
            best_step = load_checkpoint(best)["counters"].get(key)
        except UnreadableCheckpointError:  # (restore sets best.pt aside as such; learner eval names best-eval.pt's)
            best_step = None
        if best_step is not None and best_step > step:
            newer.append(best)
    if not newer:
        return
    moved = rundir.set_aside_abandoned(newer)
    log.warning(
        "resume: %s is of step %d, before the latest checkpoints in %s: the run goes on from it, and the newer "
        "ones (%s, of the run it abandons) are set aside as %s, their %s rows past step %d dropped",
        checkpoint_file,
        step,
        run_dir,
        ", ".join(p.name for p in newer),
        ", ".join(p.name for p in moved),
        rundir.METRICS,
        step,
    )


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


def earlier_sessions(run_dir: Path) -> list[Any]:
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
