"""``learner eval``: the return of a checkpoint's policy over N episodes, on local or remote envs (needs torch)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from env_server.isolation import error_phrase
from env_server.protocol import KEEPALIVE_TIMEOUT
from learner import rundir
from learner import video as video_
from learner.checkpoint import UnreadableCheckpointError, find_checkpoint, load_checkpoint, load_nets
from learner.client import RESET_TIMEOUT_HINT, TIMEOUT_HINT
from learner.config import Args, check_served_env_here, is_atari, wrapper_names, wrappers_option
from learner.device import pick_device, set_torch_threads
from learner.envs import FleetSpec, env_server_of, open_fleet
from learner.errors import (
    EnvCrashedError,
    EnvFleetError,
    RemoteEnvError,
    RemoteTimeoutError,
)
from learner.local import DEFAULT_TRANSPORT
from learner.normalize import DictRunningMeanStd, RunningMeanStd, obs_normalizer
from learner.ppo import (
    Agent,
    RawObs,
    image_keys,
    in_bounds,
    is_image_space,
    obs_map,
    observations_usable,
    raise_overflowed_return,
    raise_unusable,
    raise_unusable_rewards,
    vector_keys,
)
from learner.progress import StopRequest, bar_by_default, progress_bar
from learner.remote import DEFAULT_CONNECT_TIMEOUT, FAULT_TOLERANT_HINT
from learner.served import given_kwargs_differ, other_task
from learner.stats import format_returns, mean_of, spread_of

__all__ = ["check_seed", "evaluate", "play_episodes", "policy_of"]

log = logging.getLogger(__name__)


LONG_EPISODE = 10_000
"""Steps of an episode, in envs without a time limit, after which eval warns that it may never end."""


def _no_time_limit(envs: Any, env: str, servers: str | None) -> str | None:
    """Where ``envs`` have no time limit (not ALE games, which end at ALE's own frame cap), the way to give
    them one, for the warning of an episode that goes on and on (a deterministic policy stepping into a wall
    of CliffWalking forever); None where they have one."""
    limit = getattr(envs, "time_limit", None) or getattr(getattr(envs, "spec", None), "max_episode_steps", None)
    if limit or is_atari(env):
        return None
    return "start the servers with --max-episode-steps N" if servers else "give --max-episode-steps N"


def evaluate(
    checkpoint: str | Path,
    episodes: int = 10,
    *,
    servers: str | None = None,
    backend: str = "remote",
    num_envs: int = 4,
    seed: int = 0,
    device: str = "auto",
    deterministic: bool = True,
    transport: str = DEFAULT_TRANSPORT,
    step_socket: bool = True,
    auth_token: str | None = None,
    tls: bool | str = False,
    tls_server_name: str | None = None,
    tls_client_cert: str | None = None,
    tls_client_key: str | None = None,
    timeout: float = 30.0,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    video: str | Path | None = None,
    video_fps: float | None = None,
    env_kwargs: dict[str, Any] | None = None,
    wrappers: str | None = None,
    progress: bool | None = None,
    env: str | None = None,
    max_episode_steps: int | None = None,
) -> dict[str, Any]:
    """Mean and std return of ``episodes`` episodes of the policy in ``checkpoint`` (a file, a run dir or
    its ``checkpoints`` folder: the latest ``step-*.pt``).

    The envs are the run's (its env id, kwargs and wrappers): ``num_envs`` of them on one local env
    server, on the ``servers`` given (which must serve the run's env id, as training requires), or in
    process (``backend="gym"``; not with ``servers``: ValueError). ``env_kwargs`` (a dict) and
    ``wrappers`` (env-server wrapper names, comma-separated; ``auto``: atari for ALE ids) replace the
    run's for the envs made here (not the ``servers``', which have their own). A run trained on running
    servers records the kwargs they said they made their envs with (its checkpoints' ``served``), which
    the envs made here get; for servers too old to say (or a checkpoint of an older version), envs made
    here get a warning unless ``env_kwargs`` are given; wrappers need none: each changes the observation or action space (when
    it changes anything), which the checkpoint records, so envs without the servers' wrappers are
    refused, with a hint to pass them. Episodes are shared out over
    the envs in advance, as SB3's ``evaluate_policy`` does, so short episodes are not over-counted.
    ``transport`` is the local server's (``unix`` or ``tcp``); ``step_socket``, ``auth_token``, ``tls``,
    ``tls_server_name``, ``tls_client_cert``, ``tls_client_key``, ``timeout``, ``connect_timeout`` and ``keepalive_timeout`` are RemoteVectorEnv's.

    ``max_episode_steps``: the time limit of the envs made here (not the ``servers``', which have their
    own; None: the run's). Where the envs have none (CliffWalking, an env of your own), a warning says
    so first: the deterministic policy may never end an episode, and the episodes would then never end.

    ``env``: the run's env, named again to build it here where it imports a module (``module:Name``)
    and the run trained on running servers, which named it: see
    :func:`learner.config.check_served_env_here`. Any other name is refused.

    ``video``: also play one more episode (seed ``seed``), first, on an in-process env of the run made
    with ``render_mode="rgb_array"``, and write its frames to this path as an animated GIF, at
    ``video_fps`` frames per second (default: the env's ``render_fps``; 15 with the atari wrapper, real
    time). Frames never cross the wire, so the env must be installed here, even when the episodes run
    on servers. The result's ``video`` says what was written (see :mod:`learner.video`). Without a
    display, MuJoCo renders only with ``MUJOCO_GL=egl`` (or osmesa) set before it is first imported:
    ``learner eval`` sets it (:func:`learner.video.headless_rendering`); callers of this function may.

    ``progress``: a progress bar of the episodes on stderr (None: when stderr is a terminal, or in a Jupyter kernel), as
    ``learner train`` shows. Ctrl-C (or SIGTERM, or SIGHUP) while the episodes run stops after the current step:
    the result is then of the episodes finished (``interrupted`` true; the return's statistics None
    when none had), also where that step fails (one stuck in its env until ``timeout``, say: a warning
    says so, and it is no error); a second Ctrl-C raises KeyboardInterrupt. One during the video stops
    it after the current step too: the frames so far are written (its ``episode_ended`` false) and no
    episode is played. ``seed`` also seeds torch's generator right before the video and again right before the
    episodes, so a stochastic policy's (``deterministic=False``) returns are the same with or without
    a video.

    Servers that reset no env by themselves (``env-server --autoreset-mode Disabled``) get each env
    that ended reset here (alone, unseeded, as an autoreset is), as long as episodes are left to play.

    An error that stops the episodes (a server lost or late, an env that raised: the envs are not
    fault-tolerant, as an episode cut short is no sample of the return) is raised with the result of
    the episodes finished before it as its ``partial_result`` (``episodes_asked`` too; see
    :class:`~learner.errors.EnvFleetError`): they are a sample all the same, and ``learner eval``
    reports them. A passed deadline's error says to raise ``timeout``, the resets' deadline too.
    """
    _check_arguments(episodes, num_envs, backend, servers, seed)
    video_path = None if video is None else video_.check_path(video)  # (a bad path fails before any episode)
    video_.check_fps(video_fps)
    torch_device = pick_device(device)  # before loading anything: a bad --device fails at once
    path, state = _load_state(checkpoint)
    run_args = Args.from_json(state["args"], check=False)  # (as recorded: an older version's checks may differ)
    _check_run(run_args, path, servers, env, video=video_path is not None)
    made = _EnvsMadeHere.of(
        run_args,
        state,
        servers=servers,
        env_kwargs=env_kwargs,
        wrappers=wrappers,
        max_episode_steps=max_episode_steps,
        video=video_path is not None,
    )
    fleet = FleetSpec(
        env=run_args.env or "",  # (unused with --servers: the servers serve their env)
        servers=servers,
        backend="gym" if backend == "gym" else "remote",
        num_servers=1,
        envs_per_server=min(num_envs, episodes),
        env_kwargs=made.kwargs,
        wrappers=made.wrappers,
        max_episode_steps=made.max_episode_steps,  # (the time limit of the run's envs)
        transport="unix" if transport == "unix" else "tcp",
        step_socket=step_socket,
        auth_token=auth_token,
        tls=tls,
        tls_server_name=tls_server_name,
        tls_client_cert=tls_client_cert,
        tls_client_key=tls_client_key,
        timeout=timeout,
        connect_timeout=connect_timeout,
        keepalive_timeout=keepalive_timeout,
        # An episode cut short by a lost server is no sample of the policy's return: fail instead.
        fault_tolerant=False,
    )
    try:
        with contextlib.ExitStack() as stack, open_fleet(fleet) as envs:
            _check_envs(envs, state, run_args, made, servers=servers, wrappers=wrappers, env_kwargs=env_kwargs)
            policy = _policy(state, envs, torch_device, deterministic, path, stack)
            recorded = None
            n = envs.num_envs
            described = f"{fleet.describe()}, {n} envs" if servers is not None else fleet.describe()
            tally = _Tally.shared_out(episodes, n)
            result_of = functools.partial(_result, path, run_args.env, described, deterministic)
            then = "the episodes finished so far are reported"
            if video_path is not None:
                then = "the video as far as it got and the episodes finished so far are reported"
            # (entered before the video: a first Ctrl-C during it cuts it short there, and no episode is played)
            with StopRequest(then, log) as stop:
                if video_path is not None:  # first: a video that cannot be made fails before the episodes run
                    recorded = _record_video(
                        run_args, made, state, policy, seed, video_path, video_fps, stop, env_kwargs=env_kwargs
                    )
                # (--stochastic: the episodes sample alike with or without a video, whatever drew before)
                torch.manual_seed(seed)
                try:
                    if not stop.requested:
                        _play(envs, fleet, policy, tally, seed, stop, progress=progress)
                except EnvFleetError as err:
                    if not stop.requested:
                        # The episodes that ended before it are a sample of the return all the same (an
                        # episode cut short by the error is not one, and is not among them): kept, as
                        # Ctrl-C keeps them.
                        err.partial_result = result_of(
                            list(tally.returns), list(tally.lengths), asked=episodes, video=recorded
                        )
                        raise
                    # The step the stop waited for failed (stuck in its env until its deadline passed, say):
                    # the stop asked for stands, and the result is that of the episodes finished before it.
                    _warn_failed_at_stop(err)
            interrupted = tally.left
    except (EnvCrashedError, RemoteTimeoutError) as err:
        raise _in_own_terms(err) from err
    asked = episodes if interrupted else None
    result = result_of(tally.returns, tally.lengths, interrupted=interrupted, asked=asked, video=recorded)
    _log_result(result, episodes)
    return result


def check_seed(seed: int, num_envs: int | None) -> None:
    """``seed`` as :func:`evaluate` takes it, ValueError naming ``seed`` otherwise: env i gets ``seed + i``,
    a 64-bit seed (as RemoteVectorEnv sends it; torch's generator takes no larger). ``num_envs``: the
    envs made here (None: the servers', whose number RemoteVectorEnv checks once connected)."""
    count = num_envs or 1
    if not isinstance(seed, int | np.integer) or not 0 <= seed <= 2**64 - count:
        raise ValueError(
            f"seed: expected an integer from 0 to 2**64 - {count} ({2**64 - count}: env i gets seed + i, a 64-bit "
            f"seed), got {seed!r}"
        )


def _check_arguments(episodes: int, num_envs: int, backend: str, servers: str | None, seed: int) -> None:
    """ValueError naming the first of :func:`evaluate`'s arguments that it cannot take, before anything is loaded."""
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    if num_envs < 1:
        raise ValueError(f"num_envs: expected >= 1, got {num_envs}")
    if backend not in ("remote", "gym"):
        raise ValueError(f"backend: expected 'remote' or 'gym', got {backend!r}")
    if servers is not None and backend == "gym":
        raise ValueError(
            f"servers: evaluates on running env servers ({servers}), so it cannot go with backend='gym' (envs made "
            "in this process); leave one of the two out"
        )
    check_seed(seed, None if servers is not None else min(num_envs, episodes))


def _load_state(checkpoint: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint file ``checkpoint`` names (see :func:`~learner.checkpoint.find_checkpoint`) and its
    contents. Where the latest of a run dir, chosen here, cannot be read, its error names the run's
    checkpoint before it."""
    path = find_checkpoint(checkpoint, checkpoints_folder=True)
    try:
        return path, load_checkpoint(path)
    except UnreadableCheckpointError as err:
        if path != Path(checkpoint):  # (the latest of a run dir, chosen here: name the one before)
            run = path.resolve().parent.parent  # (resolved: "." inside checkpoints/ has no name of its own)
            step = rundir.checkpoint_step(path)
            older = [
                p for p in rundir.list_checkpoints(run) if step is not None and (rundir.checkpoint_step(p) or 0) < step
            ]
            if older:
                raise UnreadableCheckpointError(
                    f"{err}; the run's checkpoint before it is {older[-1]}: evaluate that one by its path (learner "
                    "train --resume sets the damaged one aside and goes on from the one before)"
                ) from None
        raise


def _check_run(run_args: Args, path: Path, servers: str | None, env: str | None, *, video: bool) -> None:
    """ValueError where the run in ``path`` (its ``run_args``) cannot be evaluated as asked: its env cannot
    be made here (for the episodes, without ``servers``; for the ``video``), or ``env`` names another."""
    if run_args.env is None and servers is None:  # train records the env it trained on
        raise ValueError(f"checkpoint: {path} does not name the env it was trained on; pass --servers")
    if run_args.env is None and video:
        raise ValueError(f"video: {path} does not name the env it was trained on, so it cannot be made here to render")
    if env is not None and run_args.env is not None and env != run_args.env:
        raise ValueError(f"env: expected the env the run in {path} trained on, {run_args.env}, got {env}")
    if servers is None or video:
        what = "eval" if servers is None else "--video"
        check_served_env_here(run_args.env, run_args.servers, env, what, "--env")


def _check_envs(
    envs: gym.vector.VectorEnv,
    state: dict[str, Any],
    run_args: Args,
    made: _EnvsMadeHere,
    *,
    servers: str | None,
    wrappers: str | None,
    env_kwargs: dict[str, Any] | None,
) -> None:
    """Refuse ``envs`` where the checkpoint's policy (``state``) cannot act on them: running ``servers`` of
    another env than the run's (and a warning where they make it otherwise), or other spaces than the
    policy's (ValueError, with a hint at the likely cause). The other arguments are :func:`evaluate`'s."""
    if servers is not None:
        _check_servers_env(run_args.env, str(getattr(envs, "env_id", "")), servers)
        _warn_other_task(made.served, envs, servers)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    if str(obs_space) != state["observation_space"] or str(action_space) != state["action_space"]:
        trained_on = f" ({run_args.env})" if run_args.env else ""
        env_id = getattr(envs, "env_id", None) or (None if servers else run_args.env)
        these = f"these envs ({env_id})" if env_id else "these envs"
        raise ValueError(
            f"envs: the checkpoint's policy was trained{trained_on} on observations {state['observation_space']} "
            f"and actions {state['action_space']}, but {these} have {obs_space} and {action_space}"
            + (
                _atari_hint(state["observation_space"], obs_space, servers is not None)
                or (
                    _wrappers_hint(run_args.servers, made.wrappers)
                    if made.unrecorded and servers is None and wrappers is None and "wrappers" not in made.served
                    else ""
                )
            )
            + (_env_kwargs_hint(env_kwargs, made.run_kwargs) if servers is None else "")
        )


def _policy(
    state: dict[str, Any],
    envs: gym.vector.VectorEnv,
    device: torch.device,
    deterministic: bool,
    path: Path,
    stack: contextlib.ExitStack,
) -> Callable[..., Any]:
    """The checkpoint's (``state``, from ``path``) policy on ``device``: the actions it takes on
    observations of ``envs`` (with ``video``: of the video's env, as its errors say). Torch's thread count
    is set for it, and restored when ``stack`` closes."""
    ppo = state["ppo"]
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    agent = Agent(
        obs_space, action_space, hidden_sizes=tuple(ppo["hidden_sizes"]), action_bounds=ppo["action_bounds"]
    ).to(device)
    load_nets(agent, state["model"], f"checkpoint {path}", checkpoint=state, file=path)
    agent.eval()
    threads = torch.get_num_threads()  # (restored when stack closes: the caller's process keeps its setting)
    set_torch_threads(device, is_image_space(obs_space) or bool(image_keys(obs_space)))
    stack.callback(torch.set_num_threads, threads)
    obs_rms: RunningMeanStd | DictRunningMeanStd | None = None
    if state.get("obs_rms") is not None:
        obs_rms = obs_normalizer(obs_space, vector_keys(obs_space), device)
        obs_rms.load_state_dict(state["obs_rms"])
    return policy_of(agent, obs_rms, envs, device, deterministic)


def policy_of(
    agent: Agent,
    obs_rms: RunningMeanStd | DictRunningMeanStd | None,
    envs: gym.vector.VectorEnv,
    device: torch.device,
    deterministic: bool = True,
) -> Callable[..., Any]:
    """The actions ``agent``'s policy takes (its mode, with ``deterministic``) on observations of ``envs``, normalised
    by ``obs_rms`` (--norm-obs's statistics, read and never updated; None: as they come), on ``device``: what
    :func:`evaluate` plays a checkpoint's episodes with, and ``learner train --eval-every`` its current nets'.
    An observation the policy cannot act on raises UnusableEnvOutputError naming its env (with ``video``: the
    video's)."""
    obs_space, action_space = envs.single_observation_space, envs.single_action_space

    def policy(obs: Any, video: bool = False) -> Any:
        # (looked at first, on every device: the deterministic policy acts on NaN without an error,
        # and on CUDA a forward's error is a device-side assert naming nothing; eval is no hot path)
        raw: RawObs
        if isinstance(obs, dict):  # (a Dict observation space's: a batch per key)
            raw = {key: np.asarray(value) for key, value in obs.items()}
            rows = len(next(iter(raw.values())))
        else:
            raw = np.asarray(obs)
            rows = len(raw)
        as_float32 = obs_rms is None  # (--norm-obs's float64 statistics scale them first)
        if not observations_usable(raw, obs_space, as_float32=as_float32):
            where = (lambda env: "video: ") if video else functools.partial(env_server_of, envs)
            raise_unusable(raw, obs_space, range(rows), where, as_float32=as_float32)
        x = obs_map(lambda part: part.to(device, copy=True), _tensors(raw))
        if isinstance(obs_rms, DictRunningMeanStd):  # (its vector keys; the others as they are)
            assert isinstance(x, dict)
            x = {key: obs_rms.stats[key].normalize(part) if key in obs_rms.stats else part for key, part in x.items()}
        elif obs_rms is not None:
            assert not isinstance(x, dict)
            x = obs_rms.normalize(x)
        with torch.no_grad():
            return in_bounds(agent.act(x, deterministic=deterministic).cpu().numpy(), action_space)

    return policy


def _tensors(raw: RawObs) -> Any:
    """The observations ``raw`` as CPU tensors (sharing their memory): one, or a Dict's one per key."""
    if isinstance(raw, dict):
        return {key: torch.as_tensor(value) for key, value in raw.items()}
    return torch.as_tensor(raw)


@dataclass(frozen=True)
class _EnvsMadeHere:
    """How :func:`evaluate` makes the run's envs here (on a local server, in process, and for the video):
    as the run's, as far as it recorded them, but for what the caller gave instead."""

    kwargs: dict[str, Any]
    """The env kwargs they get."""
    wrappers: tuple[str, ...]
    """The env-server wrappers they get."""
    max_episode_steps: int | None
    """Their time limit: the one given where the episodes' envs are made here, else the run's."""
    video_limit: int | None
    """The video's env's time limit: the one given (also where the episodes run on servers), else the run's."""
    served: dict[str, Any]
    """What the run's envs were beyond their id, as their servers said (the checkpoint's ``served``)."""
    run_kwargs: dict[str, Any] | None
    """The run's env kwargs (None: a run trained on running servers that did not say)."""
    unrecorded: bool
    """Whether the run trained on running servers that did not say their env kwargs, and envs are made here."""

    @classmethod
    def of(
        cls,
        run_args: Args,
        state: dict[str, Any],
        *,
        servers: str | None,
        env_kwargs: dict[str, Any] | None,
        wrappers: str | None,
        max_episode_steps: int | None,
        video: bool,
    ) -> _EnvsMadeHere:
        """The envs made here for the run of ``run_args`` and checkpoint ``state``, with :func:`evaluate`'s
        arguments of those names; ValueError for a ``max_episode_steps`` under 1. Warns where the run does
        not record the kwargs of the servers it trained on, and none were given."""
        kwargs = dict(run_args.env_kwargs) if env_kwargs is None else dict(env_kwargs)
        # What the run's envs were beyond their id, as their servers said (checkpoints since config.json's
        # envs.wrappers): a run trained on running servers has their wrappers and time limit nowhere else.
        served = state.get("served") or {}
        on_servers = run_args.servers is not None
        recorded_wrappers = wrappers_option(served["wrappers"]) if "wrappers" in served else None
        if recorded_wrappers is None and run_args.wrappers.strip() == "auto" and ":" in (run_args.env or ""):
            recorded_wrappers = "none"  # (older versions' auto gave ALE/ ids only the atari wrapper, not ale_py:ALE/)
        run_wrappers = recorded_wrappers or run_args.wrappers
        if max_episode_steps is not None and max_episode_steps < 1:
            raise ValueError(f"max_episode_steps: expected >= 1, got {max_episode_steps}")
        given_limit = max_episode_steps  # (for the envs made here: --video's too where the episodes run on servers)
        if max_episode_steps is None or servers is not None:
            max_episode_steps = served.get("max_episode_steps") if on_servers else run_args.max_episode_steps
        # The kwargs the servers' envs were made with, as they said (checkpoints since EnvSpec.env_kwargs).
        served_kwargs = served.get("env_kwargs") if on_servers else None
        run_kwargs = served_kwargs if on_servers else dict(run_args.env_kwargs)  # (None: the run does not say)
        if served_kwargs is not None and env_kwargs is None:
            kwargs = dict(served_kwargs)
        # (auto's choice by the kwargs the envs are made with: RAM observations get no atari wrapper)
        server_wrappers = wrapper_names(run_wrappers if wrappers is None else wrappers, run_args.env or "", kwargs)
        # A run trained on running servers that did not say: their env kwargs are unknown (before, their wrappers too).
        unrecorded = on_servers and served_kwargs is None and (servers is None or video)
        if unrecorded and env_kwargs is None:
            _warn_unknown_env_kwargs(
                run_args, kwargs, video_only=servers is not None, limit_known="max_episode_steps" in served
            )
        return cls(
            kwargs=kwargs,
            wrappers=server_wrappers,
            max_episode_steps=max_episode_steps,
            video_limit=given_limit or max_episode_steps,
            served=served,
            run_kwargs=run_kwargs,
            unrecorded=unrecorded,
        )


@dataclass
class _Tally:
    """The episodes :func:`evaluate` plays, shared out over the envs in advance (as SB3's ``evaluate_policy``
    does, so that short episodes are not over-counted), and those that ended so far."""

    targets: np.ndarray
    """How many episodes each env is to play."""
    counts: np.ndarray
    """How many each has played."""
    returns: list[float] = field(default_factory=list)
    """The return of each episode that ended, in the order they ended."""
    lengths: list[int] = field(default_factory=list)
    """Its length in steps."""

    @classmethod
    def shared_out(cls, episodes: int, num_envs: int) -> _Tally:
        """``episodes`` shared out over ``num_envs`` envs, none played yet."""
        return cls(np.array([(episodes + i) // num_envs for i in range(num_envs)]), np.zeros(num_envs, dtype=np.int64))

    @property
    def left(self) -> bool:
        """Whether an env has episodes left to play."""
        return bool((self.counts < self.targets).any())


def _record_video(
    run_args: Args,
    made: _EnvsMadeHere,
    state: dict[str, Any],
    policy: Callable[..., Any],
    seed: int,
    path: Path,
    fps: float | None,
    stop: StopRequest,
    *,
    env_kwargs: dict[str, Any] | None,
) -> dict[str, Any]:
    """:func:`evaluate`'s video, what :func:`learner.video.record_episode` says of it: one episode (seed ``seed``,
    torch's generator seeded too) of ``policy`` on an in-process env of the run made as ``made`` says, with
    ``render_mode="rgb_array"``, written to ``path``; cut short where ``stop`` is requested."""
    assert run_args.env is not None
    render = video_.render_spec(run_args.env, made.kwargs, made.wrappers, made.video_limit)
    spaces = (state["observation_space"], state["action_space"])
    torch.manual_seed(seed)  # (--stochastic: the video's samples, whatever came before)
    return video_.record_episode(
        render,
        functools.partial(policy, video=True),
        seed,
        path,
        fps,
        spaces,
        stop=lambda: stop.requested,
        hint=_env_kwargs_hint(env_kwargs, made.run_kwargs),
    )


def play_episodes(
    envs: gym.vector.VectorEnv,
    fleet: FleetSpec,
    policy: Callable[..., Any],
    episodes: int,
    seed: int,
    stop: StopRequest,
    *,
    progress: bool | None = False,
    on_step: Callable[[int], object] | None = None,
) -> tuple[list[float], list[int], bool]:
    """``episodes`` episodes of ``policy`` on ``envs`` (of ``fleet``; reset with ``seed``: env i gets ``seed + i``),
    shared out over the envs in advance as :func:`evaluate` shares them (its very loop): the returns and lengths
    of those that ended, and whether ``stop`` cut them short. EnvFleetError where an env or server fails (an
    episode cut short is no sample of the return). ``learner train --eval-every`` plays its evaluations so.
    ``on_step``: called with the episodes ended so far as it starts, before the envs' reset (which may wait, for
    a server down up to --connect-timeout: said all the same), and after each step (learner train's bar or lines
    say so while the evaluation runs: Recorder.evaluating)."""
    tally = _Tally.shared_out(episodes, envs.num_envs)
    # (its warnings say "eval env 0", not "env 0": in learner train's log, training's env 0 is another)
    _play(envs, fleet, policy, tally, seed, stop, progress=progress, what="eval env", on_step=on_step)
    return list(tally.returns), list(tally.lengths), tally.left


def _play(
    envs: gym.vector.VectorEnv,
    fleet: FleetSpec,
    policy: Callable[..., Any],
    tally: _Tally,
    seed: int,
    stop: StopRequest,
    *,
    progress: bool | None,
    what: str = "env",
    on_step: Callable[[int], object] | None = None,
) -> None:
    """Play the episodes ``tally`` has left with ``policy`` on ``envs`` (of ``fleet``; reset with ``seed``), and
    count those that end in it; until ``stop`` is requested. ``progress``: :func:`evaluate`'s. A warning says
    when an episode goes on and on in envs without a time limit (``what``: what it calls an env, "env 0";
    :func:`play_episodes`' "eval env 0", in learner train's log beside training's envs). ``on_step``: as
    :func:`play_episodes`'. EnvFleetError where an env or server fails, or where an episode has no return to report."""
    show = progress if progress is not None else bar_by_default()
    no_limit = _no_time_limit(envs, fleet.env, fleet.servers)
    n = envs.num_envs
    ep_return = np.zeros(n)
    ep_length = np.zeros(n, dtype=np.int64)
    valid = np.ones(n, dtype=bool)
    autoreset = envs.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    # (the bar's total: the episodes asked, which the envs' shares add up to)
    with progress_bar(show, int(tally.targets.sum()), unit="episode", scale=False) as bar:
        server_of, named = functools.partial(env_server_of, envs), f" ({fleet.describe()})"
        # (said before the reset, which may wait: for a server down, up to --connect-timeout; for a slow env)
        if on_step is not None:
            on_step(len(tally.returns))
        obs, infos = envs.reset(seed=seed)
        _raise_env_errors(infos, fleet)
        while tally.left and not stop.requested:
            obs, rewards, terms, truncs, infos = envs.step(policy(obs))
            _raise_env_errors(infos, fleet)
            # (the episode's return would be no number to report, nor JSON's)
            raise_unusable_rewards(
                np.asarray(rewards),
                valid,
                server_of,
                "a NaN or infinite reward makes no return to report",
                named=named,
            )
            with np.errstate(over="ignore"):  # (an overflowed return is raised below)
                ep_return += np.where(valid, rewards, 0.0)
            ep_length += valid
            if no_limit and ep_length.max() == LONG_EPISODE:  # (said once an episode)
                log.warning(
                    "%s %d's episode has gone on for %d steps, and these envs have no time "
                    "limit: the policy may never end it (%s)",
                    what,
                    int(ep_length.argmax()),
                    LONG_EPISODE,
                    no_limit,
                )
            ended = terms | truncs
            done = ended & valid
            for i in np.flatnonzero(done):
                if tally.counts[i] < tally.targets[i]:
                    # (rewards finite each whose sum overflowed: no return to report)
                    raise_overflowed_return(
                        ep_return, int(i), server_of, named=named, in_process=fleet.backend == "gym"
                    )
                    tally.returns.append(float(ep_return[i]))
                    tally.lengths.append(int(ep_length[i]))
                    tally.counts[i] += 1
                    if bar is not None:
                        bar.update(1)
                        texts = format_returns(mean_of(tally.returns), spread_of(tally.returns))
                        bar.set_postfix_str(f"return {' +- '.join(texts)}")
                ep_return[i], ep_length[i] = 0.0, 0
            if on_step is not None:
                on_step(len(tally.returns))
            if autoreset is gym.vector.AutoresetMode.NEXT_STEP:
                valid = ~ended  # (an ended env's next step is its reset: no step of an episode)
            more = tally.left and not stop.requested
            if autoreset is gym.vector.AutoresetMode.DISABLED and ended.any() and more:
                # No env resets itself (env-server --autoreset-mode Disabled): the ended
                # ones are reset here, alone (unseeded, as an autoreset is), for the next step.
                obs, infos = envs.reset(options={"reset_mask": ended.copy()})
                _raise_env_errors(infos, fleet)


def _result(
    path: Path,
    env: str | None,
    envs: str,
    deterministic: bool,
    returns: list[float],
    lengths: list[int],
    *,
    interrupted: bool = False,
    asked: int | None = None,
    video: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What :func:`evaluate` returns of the episodes that ended (``returns``, ``lengths``), on ``envs`` (described);
    ``interrupted``, the episodes ``asked`` and the ``video`` where there are."""
    result: dict[str, Any] = {
        "checkpoint": str(path),
        "env": env,
        "envs": envs,
        "episodes": len(returns),
        "deterministic": deterministic,
        **_statistics(returns, lengths),
        "returns": returns,
    }
    if interrupted:
        result["interrupted"] = True
    if asked is not None:
        result["episodes_asked"] = asked
    if video is not None:
        result["video"] = video
    return result


def _log_result(result: dict[str, Any], asked: int) -> None:
    """Log what :func:`evaluate` found (``result``, of ``asked`` episodes): nothing where no episode ended."""
    returns = result["returns"]
    if returns:
        spread = [] if len(returns) == 1 else [result["return_std"]]
        log.info(
            "evaluated %s over %s%s: %s",
            result["checkpoint"],
            "1 episode" if len(returns) == 1 else f"{len(returns)} episodes",
            f" (interrupted; {asked} asked)" if result.get("interrupted") else "",
            " +- ".join(format_returns(result["return_mean"], *spread)),
        )


def _statistics(returns: list[float], lengths: list[int]) -> dict[str, float | None]:
    """The return's mean, std, min and max and the mean length (None each when no episode finished)."""
    if not returns:
        return dict.fromkeys(("return_mean", "return_std", "return_min", "return_max", "length_mean"))
    return {
        "return_mean": mean_of(returns),  # (finite where the returns' sum or squares overflowed float64)
        "return_std": spread_of(returns),
        "return_min": float(np.min(returns)),
        "return_max": float(np.max(returns)),
        "length_mean": float(np.mean(lengths)),
    }


def _warn_unknown_env_kwargs(run_args: Args, kwargs: dict[str, Any], *, video_only: bool, limit_known: bool) -> None:
    """Say that the envs made here may not be the ones a run trained on running servers stepped: their
    kwargs (a task's length, a level) can differ with the same spaces. (Their wrappers cannot: each of
    the env server's changes a space whenever it changes anything, and the spaces are checked; runs
    since config.json's envs.wrappers record them, and the servers' time limit.)"""
    what = "env kwargs" if limit_known else "env kwargs and time limit"
    made = "the video's env, made here, gets" if video_only else "the envs made here get"
    limit = "" if limit_known else " and the env's own time limit"
    elsewhere = "" if video_only else " (or evaluate on such servers with --servers)"
    log.warning(
        "the run trained on running env servers (%s), whose %s it does not record; %s env kwargs %s%s: if those "
        "servers were started with other kwargs, pass them as --env-kwargs%s",
        run_args.servers,
        what,
        made,
        json.dumps(kwargs),
        limit,
        elsewhere,
    )


def _check_servers_env(trained_on: str | None, served: str, servers: str) -> None:
    """Refuse servers of another env than the run's, as ``learner train`` refuses them for a run it resumes
    (the same policy: their ids must be equal): equal spaces do not make the same task (CartPole-v0 and
    -v1 differ only in their time limit and threshold), and the return would be reported under the run's env."""
    if trained_on is not None and served and served != trained_on:
        raise ValueError(
            f"--servers: the checkpoint's policy was trained on {trained_on}, but the servers at {servers} serve "
            f"{served}; evaluate it on servers of {trained_on}"
        )


def _warn_other_task(served: dict[str, Any], envs: Any, servers: str) -> None:
    """Warn where the servers at ``servers`` make their envs (``envs``) otherwise than the run's (``served``; see
    :func:`~learner.served.other_task`). Not refused: evaluating a policy on a variant of its task can be the
    point."""
    differ = other_task(served, envs)
    if differ:
        log.warning(
            "--servers: the servers at %s make their envs otherwise than the envs the run trained on: %s; the "
            "returns are of that task, not the one the policy learned (evaluate on servers started as the run's, "
            "or leave --servers out: eval makes envs as the run's)",
            servers,
            "; ".join(differ),
        )


def _wrappers_hint(trained_on: str | None, wrappers: tuple[str, ...]) -> str:
    """A hint when envs made here for a run trained on running servers have other spaces: those servers'
    wrappers (or kwargs) were not recorded."""
    return (
        f"; the run trained on running env servers ({trained_on}), whose wrappers and env kwargs it does not "
        f"record, and these envs got wrappers {','.join(wrappers) or 'none'}: pass those servers' as --wrappers "
        "(and --env-kwargs)"
    )


def _env_kwargs_hint(given: dict[str, Any] | None, run_kwargs: dict[str, Any] | None) -> str:
    """A hint when envs made here have other spaces than the policy's and were made with env kwargs
    ``given`` (--env-kwargs) other than the run's (``run_kwargs``): :func:`~learner.served.given_kwargs_differ`.
    "" where none were given, or the run's were, or the run does not record its own (None: a run on servers
    too old to say, whose kwargs the user was told to pass; :func:`_wrappers_hint` speaks of them)."""
    differ = given_kwargs_differ(given, run_kwargs, leave_out_to="make them as the run's")
    return f"; they were {differ}" if differ else ""


def _raise_env_errors(infos: dict[str, Any], fleet: FleetSpec) -> None:
    """In-process envs (``backend="gym"``) isolate an env's exception as the servers do (its episode ends as
    truncated, ``infos["env_error"]`` says why): an episode cut short is no sample of the return, so fail,
    as RemoteVectorEnv does when not fault-tolerant."""
    errors = infos.get("_env_error")
    if errors is None or not np.any(errors):
        return
    index = int(np.flatnonzero(errors)[0])
    raise EnvFleetError(
        f"envs: env {index} ({fleet.describe()}) {error_phrase(str(infos['env_error'][index]))}; eval stops at an env's "
        "error, as an episode cut short is no sample of the policy's return"
    )


OWN_TERMS = (
    (FAULT_TOLERANT_HINT, "eval stops at an env's error, as an episode cut short is no sample"),
    (RESET_TIMEOUT_HINT, f"{TIMEOUT_HINT} to reset"),
)
"""RemoteVectorEnv's advice that evaluate() words in its own terms, (library phrase, evaluate()'s): it
stops at an env's error (no ``fault_tolerant`` to pass), and its ``timeout`` is the resets' deadline
too (it has no ``reset_timeout``). ``learner eval`` takes these first, then names its options."""


def _in_own_terms(err: RemoteEnvError) -> RemoteEnvError:
    """``err`` with its advice in evaluate()'s terms (:data:`OWN_TERMS`), not RemoteVectorEnv's. The
    same type and attributes, ``partial_result`` included; its notes (the other servers' errors)
    reworded alike. (``learner eval`` names its options where it prints.)"""

    def reword(text: str) -> str:
        for library, own in OWN_TERMS:
            text = text.replace(library, own)
        return text

    new = type(err)(reword(str(err)), address=err.address, code=err.code, env_index=err.env_index)
    new.partial_result = err.partial_result
    for note in getattr(err, "__notes__", ()):
        new.add_note(reword(note))
    return new


def _warn_failed_at_stop(err: EnvFleetError) -> None:
    """Say that ``err`` ended the step a stop (Ctrl-C, SIGTERM, SIGHUP) waited for: eval stops there as
    asked, so its advice to raise the deadline is left out (a step stuck in its env passes any), and
    the rest is in evaluate()'s terms (:data:`OWN_TERMS`)."""
    text = str(err)
    for hint in (TIMEOUT_HINT, RESET_TIMEOUT_HINT):
        text = text.replace(f"; {hint}", "")
    for library, own in OWN_TERMS:
        text = text.replace(library, own)
    log.warning("the step under way when the stop was asked failed: %s; stopped there", text)


# What the env server's atari wrapper serves (env_server.envs: 84x84 grayscale, a stack of 4 frames).
_ATARI_OBSERVATIONS = re.compile(r"^Box\(0, 255, \(4, 84, 84\), uint8\)$")


def _atari_hint(trained_on: str, found: gym.Space[Any], on_servers: bool) -> str:
    """A hint when the policy saw the atari wrapper's frames and the envs serve larger raw frames."""
    raw = isinstance(found, gym.spaces.Box) and found.dtype == np.uint8 and len(found.shape) == 3
    if not (_ATARI_OBSERVATIONS.match(trained_on) and raw and str(found) != trained_on):
        return ""
    if on_servers:
        return (
            "; the policy saw the env server's atari wrapper's 4x84x84 frame stacks, and these look like raw frames: "
            "start the servers with --wrappers atari"
        )
    return "; the policy saw the env server's atari wrapper's 4x84x84 frame stacks: pass --wrappers atari"
