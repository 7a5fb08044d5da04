"""The ``learner`` command (also ``python -m learner``): train, eval, servers, plot, bench, demo and check.

Only this module reads the command line. torch loads only for the commands that need it (train, eval).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import itertools
import json
import logging
import os
import select
import shlex
import signal
import statistics
import sys
import textwrap
import threading
import time
import types
import typing
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal, NoReturn

# Nothing imported here may import grpc: main() tunes gRPC's core first (env_server.tuning), which
# works only before grpc is imported. Commands import what they need when they run.
from env_server.config import VECTORIZATION_NOTES, add_stepping_option, json_object_option, parse_on_off
from env_server.envs import EnvBuildError
from env_server.protocol import KEEPALIVE_TIMEOUT
from env_server.tuning import (
    LOG_FORMATS,
    ShortErrorParser,
    VersionAction,
    configure_logging,
    prefer_fast_grpc_core,
    to_devnull,
)
from learner.argtypes import int_list, integer, number, positive_int, positive_seconds, real
from learner.benchmarks.ppo import PPO_LAYOUTS  # (standard library only: no grpc)
from learner.config import PRESETS, Args, check_addresses, check_device, check_tls, check_wrappers, is_atari
from learner.errors import (
    EnvFleetError,
    OptionError,
    RunCompleteError,
    TrainingInterrupted,
    install_hint,
    os_reason,
    out_of_fds,
)
from learner.fleet import FleetChange, describe_change
from learner.interrupts import interrupts_held
from learner.local import DEFAULT_TRANSPORT, HANG_TIMEOUT_S, crowding, raise_fd_limit
from learner.progress import ending_as_interrupt, note_ctrl_c, stopped_by_ctrl_c, stopping_with_parent
from learner.rundir import (
    BEST_CHECKPOINT,
    BEST_EVAL_CHECKPOINT,
    CHECKPOINTS,
    CONFIG,
    check_name_lengths,
    checkpoint_path,
    list_checkpoints,
    make_new_dir,
    read_json,
)

if typing.TYPE_CHECKING:
    import gymnasium as gym

__all__ = ["build_parser", "main"]

# Errors a user can act on from their message alone: one line, no traceback.
_USER_ERRORS = (EnvFleetError, EnvBuildError, ValueError, FileExistsError, FileNotFoundError)

LOG_LEVELS = ["debug", "info", "warning", "error"]
LOG_LEVEL_HELP = "what the learner logs to stderr: debug, info, warning or error (default: warning)"
LOG_FORMAT_HELP = (
    "text: a line per log record; json: a JSON object per line (time, level, logger, message, exception), local "
    "env servers' lines included, for log collectors; {printed} (default: text)"
)
# (--no-progress only where the command has --progress: train and eval)
_PRINTED, _PRINTED_WITH_BAR = (
    "results are printed as they are",
    "progress bars and results are printed as they are (--no-progress drops the bar)",
)

# What the learner extra brings (pyproject.toml: envfleet[learner]); the commands that need them import
# them when they run, so a missing one is reported as a missing install, not as a traceback.
_LEARNER_EXTRA = ("torch", "tensorboard", "tqdm", "matplotlib")


def _threads() -> int:
    """The threads of this process: the OS's count where it says (gRPC's C-core threads and torch's, which
    Python's threading does not know of, would be copied by a fork too), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _measure(envs: gym.vector.VectorEnv, steps: int, seed: int) -> tuple[float, int]:
    """Env-steps per second of random actions, and how many episodes ended."""
    import numpy as np

    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    actions = [envs.action_space.sample() for _ in range(64)]
    envs.step(actions[0])  # warm-up
    episodes = 0
    start = time.perf_counter()
    for t in range(steps):
        _, _, terminations, truncations, _ = envs.step(actions[t % len(actions)])
        episodes += int(np.sum(terminations | truncations))
    elapsed = time.perf_counter() - start
    return steps * envs.num_envs / elapsed, episodes


def _quiet_async_worker(*args: Any) -> None:
    """gymnasium's AsyncVectorEnv worker, deaf to Ctrl-C and with SIGTERM and SIGHUP at their defaults:
    a terminal's Ctrl-C reaches every process of the demo, and a worker forked from this process had
    its handlers (each printed a KeyboardInterrupt traceback); the demo closes its workers itself."""
    from gymnasium.vector.async_vector_env import _async_worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)
    _async_worker(*args)


def cmd_demo(args: argparse.Namespace) -> int:
    """Start local env servers, step a RemoteVectorEnv over them, and compare with AsyncVectorEnv."""
    import functools

    import gymnasium as gym

    from env_server.config import ServerConfig
    from env_server.envs import make_env, worker_context
    from learner.benchmarks.report import load_warning
    from learner.interrupts import interrupts_held, start_forkserver_deaf_to_ctrl_c
    from learner.local import LocalServers
    from learner.remote import RemoteVectorEnv

    # (the load before the demo's own processes add theirs: other work that competes with both sides)
    machine = {"cpus": os.cpu_count(), "load_average_start": list(os.getloadavg())}
    total = args.num_servers * args.envs_per_server
    try:
        config = ServerConfig(env=args.env, env_kwargs=args.env_kwargs)
    except ValueError as err:
        args.parser.error(f"--{err}")  # ("env: expected a gymnasium id ...")
    try:
        make_env(config).close()  # (one env, here: what a server would fail to build, said before any starts)
    except Exception as err:
        kwargs = f" with --env-kwargs {json.dumps(args.env_kwargs)}" if args.env_kwargs else ""
        raise ValueError(f"--env {args.env}: cannot build it{kwargs}: {type(err).__name__}: {err}") from None
    print(
        f"envfleet demo: {args.env}, {args.num_servers} local servers x {args.envs_per_server} envs, {args.steps} steps"
    )
    # gymnasium's AsyncVectorEnv, its workers forked on Linux (before this process opens gRPC channels; fork
    # named: since Python 3.14 multiprocessing's default there is forkserver; elsewhere the platform's default,
    # spawn on macOS) unless threads run here (gRPC's, tqdm's: learner.cli.main called from a script or a
    # notebook that used them), which a fork must not copy (Python 3.12+ warns of the deadlocks that risks):
    # then a forkserver starts them (which runs the calling script again, as multiprocessing's spawn does,
    # unless its code is under `if __name__ == "__main__":`). Its envs are built as the servers build theirs
    # (ids or entry points, the same --env-kwargs).
    one_env = functools.partial(make_env, config)
    context = worker_context() if _threads() == 1 else "forkserver"
    if context == "forkserver":  # (numpy's OpenBLAS threads are enough: on most machines)
        start_forkserver_deaf_to_ctrl_c()
    reference = None
    try:
        # (whole, unless Ctrl-C comes twice: one as its workers started, deaf to it, left those still starting to
        # start after this process had gone, each printing a traceback, "SemLock._rebuild ... FileNotFoundError")
        with interrupts_held(breakable=True):
            reference = gym.vector.AsyncVectorEnv([one_env] * total, context=context, worker=_quiet_async_worker)
        ref_sps, _ = _measure(reference, args.steps, args.seed)
    except BaseException:
        if reference is not None:
            with warnings.catch_warnings():  # ("Calling `close` while waiting for a pending call to `step`")
                warnings.simplefilter("ignore")
                reference.close(terminate=True)  # (a Ctrl-C: mid-step, not waited for)
        raise
    reference.close()
    with LocalServers(
        args.env, args.num_servers, args.envs_per_server, env_kwargs=args.env_kwargs, transport=args.transport
    ) as servers:
        print(f"servers: {', '.join(servers.addresses)}")
        with RemoteVectorEnv(servers.addresses, step_socket=args.step_socket) as envs:
            sps, episodes = _measure(envs, args.steps, args.seed)
    how = args.transport + (", step sockets" if args.transport == "unix" and args.step_socket else "")
    print(f"{'vector env':<50} {'env-steps/s':>12}")
    print(f"{f'RemoteVectorEnv ({args.num_servers} x {args.envs_per_server}, {how})':<50} {sps:>12,.0f}")
    print(f"{f'gymnasium AsyncVectorEnv ({total})':<50} {ref_sps:>12,.0f}")
    print(f"ratio remote / async: {sps / ref_sps:.2f}; {episodes} episodes ended on the remote envs")
    warning = load_warning(machine, spread=False)
    if warning:
        print(f"{warning} Run it again on an idle machine to compare them.")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Check an env through one local env server against gymnasium's own vector env (learner.check)."""
    from learner.check import CheckLine, CheckOptions, run_check, server_config
    from learner.config import wrapper_names

    try:
        check_wrappers(args.wrappers)
        options = CheckOptions(
            env=args.env,
            env_kwargs=args.env_kwargs,
            num_envs=args.num_envs,
            steps=args.steps,
            seed=args.seed,
            max_episode_steps=args.max_episode_steps,
            wrappers=wrapper_names(args.wrappers, args.env, args.env_kwargs),
            transport=args.transport,
            step_socket=args.step_socket,
            vectorization=args.vectorization,
            autoreset_mode=args.autoreset_mode,
            hang_timeout=args.hang_timeout,
        )
        server_config(options)
    except ValueError as err:  # (the options only: a ValueError the env raised is a failed check, no usage error)
        args.parser.error(str(err))

    def say(line: CheckLine) -> None:  # (as found: a check that hangs, or is stopped by Ctrl-C, shows how far it got)
        print(f"{line.status:<8} {line.check + ':':<17} {line.message}", flush=True)

    result = run_check(options, on_line=say)
    verdict = "FAILED" if result.failed else "passed"
    print(f"{args.env}: {verdict} ({result.warnings} warning{'s' if result.warnings != 1 else ''})")
    return 1 if result.failed else 0


# -- train ---------------------------------------------------------------------------------------------------


def _track_variable() -> bool | None:
    """$ENVFLEET_TRACK (None: unset or empty), a new run's --track where neither --track nor --no-track is
    given (a container's command stays as it is: compose passes the variable)."""
    text = os.environ.get("ENVFLEET_TRACK", "").strip()
    if not text:
        return None
    try:
        return parse_on_off(text)
    except ValueError as err:
        raise ValueError(f"$ENVFLEET_TRACK: {err}") from None


def _check_device(args: argparse.Namespace, spec: str) -> None:
    """--device as a usage error (exit 2) where it names a device this host lacks (cuda with no GPU): found by
    train and eval once they run, it was an error of the run's (exit 1), as no other bad option is."""
    import torch

    from learner.device import pick_device

    try:
        pick_device(spec)
    except ValueError as err:
        # (what to do, where the host has no GPU at all: a cuda:N beyond its GPUs is told which there are)
        args.parser.error(f"{err}: give --device cpu, or auto" if not torch.cuda.is_available() else str(err))


def _say_a_slow_start(config: Args) -> None:
    """Say that the local servers about to start are many for the CPUs, so take a while (64 servers on 2 CPUs: ~30 s
    with nothing said, each server's start ~0.6 s of CPU); nothing for SERVERS_PER_CPU or fewer on each."""
    if config.servers is not None or config.backend != "remote":
        return
    count, per = config.local_layout()
    crowd, cpus = crowding(count)
    if crowd > 1:
        print(  # (stderr, a note as logs are: stdout's first line stays the run's, which `| head -1` reads)
            f"learner train: starting {count} local env servers ({per} x {config.env} each) on {cpus} "
            f"CPU{'s' if cpus != 1 else ''}: they take a while",
            file=sys.stderr,
            flush=True,
        )


def cmd_train(args: argparse.Namespace) -> int:
    """Build ``Args`` from the options given, train, and print where the results are."""
    given = _given(args, Args)
    try:
        token = _auth_token(args.auth_token_file, given.get("auth_token"))
        if token is not None:
            given["auth_token"] = token
        if args.like is not None and "resume" in given:
            raise ValueError("--like: starts a new run with another run's options, so it cannot go with --resume")
        # (a new run's default, as $WANDB_PROJECT's below: a run resumed or repeated keeps its own)
        if "track" not in given and "resume" not in given and args.like is None:
            tracked = _track_variable()
            if tracked is not None:
                given["track"] = args.tracked_by_variable = tracked  # (said if wandb is then missing)
        wandb_names = [name for name in ("wandb_project_name", "wandb_entity") if name in given]
        if "resume" not in given and args.like is None and os.environ.get("WANDB_PROJECT"):
            given.setdefault("wandb_project_name", os.environ["WANDB_PROJECT"])  # (a run resumed keeps its own)
        if "resume" in given:
            from learner.resume import resume_args

            config = resume_args(given.pop("resume"), **given)
        elif args.like is not None:
            from learner.resume import like_args

            config = like_args(args.like, **given)
        else:
            config = Args(**given)
        config = _tls_from_environment(config)
        if wandb_names and not config.track:
            flag = f"--{wandb_names[0].replace('_', '-')}"
            raise ValueError(f"{flag}: names where --track logs the run to W&B; give --track too")
    except (ValueError, FileNotFoundError) as err:
        args.parser.error(str(err))
    from learner.stats import format_return
    from learner.train import train

    _check_device(args, config.device)
    if config.capture_video:
        from learner.video import headless_rendering

        headless_rendering()  # (process-wide, so here: before any server starts, as MuJoCo reads it on import)
    run_dir_known = config.run_dir or config.resume  # (for a second Ctrl-C; else once the run dir is made)

    session_started = False  # (its envs up and config.json written: a resume goes on with this session's options)

    def started(info: dict[str, Any]) -> None:
        nonlocal run_dir_known, session_started
        run_dir_known, session_started = info["run_dir"], True
        envs, ppo = info["envs"], info["ppo"]
        print(
            f"learner train: PPO ({ppo['preset']} preset, {info['policy']}) on {envs['env_id']}: {envs['description']}; "
            f"{envs['num_envs']} envs, device {info['device']}\nrun dir: {info['run_dir']}",
            flush=True,
        )
        if "resumed_from" in info:
            print(f"resuming from {info['resumed_from']} ({info['resumed_step']:,} steps)", flush=True)
        if "metrics_url" in info:
            print(f"Prometheus metrics: {info['metrics_url']}", flush=True)
        from learner.fleetwatch import every_replica, replica_metrics_note  # (imported by train by now)

        if not every_replica(info["args"]["replica_metrics"], servers := len(envs["addresses"])):
            print(replica_metrics_note(servers), flush=True)

    def fleet_changed(change: FleetChange) -> None:
        from tqdm import tqdm

        tqdm.write(describe_change(change), file=sys.stdout)  # above the progress bar, which stays
        sys.stdout.flush()

    _say_a_slow_start(config)
    try:
        with _option_terms(args), stopping_with_parent(args.parent_pid):
            summary = train(config, on_start=started, on_fleet_change=fleet_changed)
    except RunCompleteError as err:  # (nothing left to do: an error only where a new target was asked for)
        if {"total_timesteps", "stop_at_return"} & given.keys():
            args.parser.error(str(err))
        print(f"learner train: done already: {err}", flush=True)
        return 0
    except OptionError as err:  # (an option found wrong once the run's checkpoint or servers are seen)
        args.parser.error(str(err))
    except TrainingInterrupted as stopped:  # the first Ctrl-C (SIGTERM, SIGHUP): stopped at a step, files written
        summary = stopped.summary  # (said as a finished run's, with how to resume it; exit 130)
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops training at the next step)
        _say_end(args, aborted_line(run_dir_known))
        return 130
    except EnvFleetError as err:  # (the servers given up on, an env that keeps raising, ...: said by main)
        # (before the session started, --resume DIR alone would not take this command's options: no hint)
        line = failed_line(run_dir_known) if session_started else None
        if line:
            err.add_note(line)
        raise
    run_dir = Path(summary["run_dir"])
    recent, ended = summary["final_return_mean"], min(int(summary.get("episodes", 20)), 20)
    returns = (
        "no episode ended" + _no_time_limit_hint(run_dir)
        if recent is None
        else f"mean return of the last {ended} episode{'' if ended == 1 else 's'}: {format_return(recent)}"
    )
    print(f"{summary['total_steps']:,} env steps in {summary['seconds']:.1f} s; {returns}")
    for line in (_faults_line(summary), slowest_line(summary)):
        if line:
            print(line)
    if summary["solved"]:
        print(
            f"solved (mean return >= {summary['solved_threshold']:g}) at step {summary['solved_at_step']:,}, "
            f"after {summary['solved_at_seconds']:.1f} s"
        )
    elif summary["solved_threshold"] is not None and summary["stop_reason"] != "interrupted":
        print(f"not solved (mean return >= {summary['solved_threshold']:g} not reached)")
    best = run_dir / CHECKPOINTS / BEST_CHECKPOINT
    if summary.get("best_return") is not None and config.save_best and best.exists():
        print(f"best: mean return {format_return(summary['best_return'])} at step {summary['best_step']:,} ({best})")
    if summary.get("best_eval_return") is not None:  # (--eval-every)
        best_eval = run_dir / CHECKPOINTS / BEST_EVAL_CHECKPOINT
        kept = f" ({best_eval})" if config.save_best and best_eval.exists() else ""
        print(
            f"best evaluation: mean return {format_return(summary['best_eval_return'])} at step "
            f"{summary['best_eval_step']:,}{kept}; the last: {format_return(summary['eval_return_mean'])}"
        )
    if summary["stop_reason"] == "interrupted":
        print(interrupted_line(run_dir, summary["total_steps"]))
    written = ["metrics.jsonl", "TensorBoard events" if config.tensorboard else "", "checkpoints/", "summary.json"]
    if summary.get("videos"):  # (--capture-video)
        written.append(f"videos/ ({len(summary['videos'])} GIF{'' if len(summary['videos']) == 1 else 's'})")
    print(f"run dir: {run_dir}  ({', '.join(w for w in written if w)})")
    if "wandb_run" in summary:  # (--track)
        wandb_run = summary["wandb_run"]
        where = wandb_run["url"] or f"{wandb_run['id']}, offline (upload it with: wandb sync {wandb_run['files']})"
        print(f"W&B run: {where}")
    plotted = config.plot and (run_dir / "returns.png").exists()
    if plotted:
        print(f"plot: {run_dir / 'returns.png'}")
    if summary["stop_reason"] in ("total_timesteps", "stop_at_return"):
        plot = not plotted and recent is not None
        down = {key for key, replica in summary.get("replicas", {}).items() if replica.get("available") is False}
        print(finished_line(run_dir, plot, servers=config.servers, tls=tls_options(config), down=down))
    return 130 if summary["stop_reason"] == "interrupted" else 0


def _auth_token(token_file: str | None, token: str | None) -> str | None:
    """The token --auth-token-file names (else $ENVFLEET_AUTH_TOKEN_FILE's, else $ENVFLEET_AUTH_TOKEN) when
    --auth-token (``token``) is not given: read as env-server reads it, surrounding whitespace ignored.
    None: no token from these. A flag given beats a variable; two of one kind are refused."""
    if token_file is not None and token is not None:
        raise ValueError("--auth-token and --auth-token-file: give one of them, not both")
    if token is not None:
        return None
    where = "--auth-token-file"
    if token_file is None and os.environ.get("ENVFLEET_AUTH_TOKEN_FILE"):
        token_file, where = os.path.expanduser(os.environ["ENVFLEET_AUTH_TOKEN_FILE"]), "$ENVFLEET_AUTH_TOKEN_FILE"
        if os.environ.get("ENVFLEET_AUTH_TOKEN"):
            raise ValueError(
                "$ENVFLEET_AUTH_TOKEN and $ENVFLEET_AUTH_TOKEN_FILE: both are set; set one of them, not both "
                "(or give --auth-token or --auth-token-file)"
            )
    from env_server.protocol import check_token

    if token_file is None:  # like env-server, from the environment
        variable = os.environ.get("ENVFLEET_AUTH_TOKEN")
        return check_token(variable, "$ENVFLEET_AUTH_TOKEN") if variable else None
    try:
        with open(token_file) as f:
            text = f.read().strip()
    except OSError as err:
        raise ValueError(f"{where} {token_file}: cannot read it: {os_reason(err)}") from None
    return check_token(text, f"{where} {token_file}")


def _connection(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """(auth token, TLS keyword arguments of RemoteVectorEnv: ``tls``, ``tls_server_name``,
    ``tls_client_cert``, ``tls_client_key``) from the connection options of ``eval`` and ``servers``
    (:func:`_add_connection_options`), checked as ``train`` checks its own: a usage error where they
    do not fit."""
    from env_server.protocol import check_token

    try:
        check_addresses(args.servers, "ADDRESSES" if getattr(args, "addresses", None) is not None else "--servers")
        check_tls(
            args.servers,
            args.tls,
            args.tls_ca,
            args.tls_server_name,
            "the env server this command starts speaks",
            args.tls_client_cert,
            args.tls_client_key,
        )
        if args.auth_token is not None:
            check_token(args.auth_token, "--auth-token")
        token = _auth_token(args.auth_token_file, args.auth_token) or args.auth_token
        tls_ca, tls_server_name = _tls_variables(args.servers, args.tls, args.tls_ca, args.tls_server_name)
        cert, key = _client_cert_variables(args.servers, args.tls or tls_ca, args.tls_client_cert, args.tls_client_key)
    except ValueError as err:
        args.parser.error(str(err))
    tls = {
        "tls": tls_ca or args.tls,
        "tls_server_name": tls_server_name,
        "tls_client_cert": cert,
        "tls_client_key": key,
    }
    return token, tls


def _tls_from_environment(config: Args) -> Args:
    """``config`` with --tls-ca, --tls-server-name and the client certificate from the environment where
    neither they nor a resumed run's config.json set them (see :func:`_tls_variables` and
    :func:`_client_cert_variables`)."""
    tls_ca, name = _tls_variables(config.servers, config.tls, config.tls_ca, config.tls_server_name)
    cert, key = _client_cert_variables(
        config.servers, config.tls or tls_ca, config.tls_client_cert, config.tls_client_key
    )
    return dataclasses.replace(config, tls_ca=tls_ca, tls_server_name=name, tls_client_cert=cert, tls_client_key=key)


def _readable(path: str, where: str, hint: str = "") -> None:
    """ValueError "``where`` ``path``: cannot read it (why)``hint``" unless ``path`` can be opened."""
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ValueError(f"{where} {path}: cannot read it ({os_reason(err)}){hint}") from None


def _tls_variables(
    servers: str | None, tls: bool, tls_ca: str | None, tls_server_name: str | None
) -> tuple[str | None, str | None]:
    """(--tls-ca, --tls-server-name), each from $ENVFLEET_TLS_CA / $ENVFLEET_TLS_SERVER_NAME (the
    variables env-server's health probe reads) where None: for --servers only (local servers this
    command starts speak plaintext), the name only with TLS. A CA file the variable names that cannot
    be read here (a container's path, exported for compose) is named as the variable's."""
    from learner.client import ca_roots

    if tls_ca is not None:
        _readable(tls_ca, "--tls-ca")
        ca_roots(tls_ca, "--tls-ca")  # (InvalidArgumentError, a ValueError: said as a usage error)
    if servers is None:
        return tls_ca, tls_server_name
    if tls_ca is None and os.environ.get("ENVFLEET_TLS_CA"):
        tls_ca = os.path.expanduser(os.environ["ENVFLEET_TLS_CA"])  # (a ~ as env-server and its probe take it)
        _readable(
            tls_ca,
            "$ENVFLEET_TLS_CA",
            "; it gives --tls-ca for --servers: set it to the CA file on this machine, unset it, or give --tls-ca",
        )
        ca_roots(tls_ca, "$ENVFLEET_TLS_CA")
    if tls_server_name is None and (tls or tls_ca) and os.environ.get("ENVFLEET_TLS_SERVER_NAME"):
        tls_server_name = os.environ["ENVFLEET_TLS_SERVER_NAME"]
    return tls_ca, tls_server_name


_CLIENT_CERT_VARIABLES = ("ENVFLEET_TLS_CLIENT_CERT", "ENVFLEET_TLS_CLIENT_KEY")
"""The variables that give --tls-client-cert and --tls-client-key (as env-server's health probe reads them)."""


def _client_cert_variables(
    servers: str | None, tls: bool | str | None, cert: str | None, key: str | None
) -> tuple[str | None, str | None]:
    """(--tls-client-cert, --tls-client-key), both from $ENVFLEET_TLS_CLIENT_CERT and
    $ENVFLEET_TLS_CLIENT_KEY where neither option is given (a pair: never a certificate from one place
    and its key from another): for --servers with TLS only (``tls``: --tls, or the CA in use). Checked:
    readable, PEM, and a certificate with its own key; a file a variable names is named as the variable's."""
    flags = ("--tls-client-cert", "--tls-client-key")
    names: tuple[str, str] = flags
    hint = ""
    if cert is None and key is None and servers is not None and tls:
        cert, key = (os.path.expanduser(os.environ.get(v) or "") or None for v in _CLIENT_CERT_VARIABLES)
        if (cert is None) != (key is None):
            set_one = _CLIENT_CERT_VARIABLES[0 if cert is not None else 1]
            raise ValueError(
                f"${_CLIENT_CERT_VARIABLES[0]} and ${_CLIENT_CERT_VARIABLES[1]}: set both (the client certificate "
                f"and its private key) or neither, got ${set_one} alone (or give --tls-client-cert and "
                "--tls-client-key)"
            )
        names = ("$" + _CLIENT_CERT_VARIABLES[0], "$" + _CLIENT_CERT_VARIABLES[1])
        hint = "; it gives {flag} for --servers: set it to the file on this machine, unset it, or give {flag}"
    if cert is None or key is None:
        return cert, key
    for path, name, flag in ((cert, names[0], flags[0]), (key, names[1], flags[1])):
        _readable(path, name, hint.format(flag=flag))
    from learner.client import client_identity

    client_identity(cert, key, *names)  # (InvalidArgumentError, a ValueError: said as a usage error)
    return cert, key


def _no_time_limit_hint(run_dir: Path) -> str:
    """Where no episode ended and the run's envs had no time limit (config.json's envs: CliffWalking, an
    env of your own), what to give; else "". Not for ALE games (which end at game over or at ALE's own
    frame cap, and take no --max-episode-steps), nor where the envs did not say their kwargs (servers too
    old to say may have said no time limit whatever theirs was)."""
    try:
        config = read_json(run_dir / CONFIG)
        args, envs = config.get("args") or {}, config.get("envs") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    if envs.get("env_kwargs") is None or envs.get("max_episode_steps", 1) or is_atari(str(args.get("env") or "")):
        return ""
    where = (
        "start the servers with --max-episode-steps N"
        if args.get("servers")
        else "give --max-episode-steps N (learner train passes it to the envs it makes)"
    )
    return f" (its envs have no time limit, so an episode may never end: {where})"


def _faults_line(summary: dict[str, Any]) -> str:
    """What the fleet's failures and changes cost the run ("" when there were none)."""
    parts = []
    for key, one, many in (
        ("failures", "server failure", "server failures"),
        ("shutdowns", "server shut down", "servers shut down"),
        ("reconnects", "reconnect", "reconnects"),
        ("server_restarts", "server restart", "server restarts"),
        ("servers_left", "server left", "servers left"),
        ("servers_joined", "server joined", "servers joined"),
        ("env_steps_lost", "env step lost", "env steps lost"),
        ("episodes_cut", "episode cut short", "episodes cut short"),
    ):
        count = summary.get(key) or 0
        if count:
            parts.append(f"{count:,} {one if count == 1 else many}")
            if key == "env_steps_lost":  # (steps that were no transition: their env was unavailable)
                parts[-1] += f" ({count / max(summary['total_steps'], 1):.1%} of the run's)"
    # (this session's, per server: see learner.faults.STALL)
    stalled = {name: n for name, replica in (summary.get("replicas") or {}).items() if (n := replica.get("stalls"))}
    if stalled:
        count = sum(stalled.values())
        servers = ", ".join(f"{name} {n:,}" for name, n in stalled.items())
        parts.append(f"{count:,} stalled step{'' if count == 1 else 's'} ({servers})")
    return "faults: " + ", ".join(parts) if parts else ""


SLOWEST_RATIO = 1.2
SLOWEST_MIN_MS = 0.1
"""The closing lines name the slowest env server if its envs' median step time (``env_p50_ms``, which
each server measures and reports) is at least SLOWEST_RATIO times the other servers' median and
SLOWEST_MIN_MS longer: of servers alike, none is "the slowest"."""
SLOWEST_ROUND_TRIP_RATIO = 1.5
SLOWEST_ROUND_TRIP_MIN_MS = 0.5
"""... or else if its median round trip is this many times the others' and this many ms longer (a far
or overloaded network, a busy server): a wider margin, because round trips of sub-millisecond steps,
as the learner times them, depend on the order it serves the servers in. It sends a step to one
server after the other (RemoteVectorEnv._start), each clock starting as its own send does, and takes
in the answers that came while it computed (the critic's values) when it next looks, together; so
the first server's round trip also counts the sends to the others, and on a machine of few cores
the first send wakes that server, which can take the core the learner sends the next from
(pipelined, it counts the policy's forward pass on the next group too). Two identical local servers
on 2 cores measure 15-40 % apart that way (0.98 vs 0.85 ms, 1.40 vs 0.98 ms), local-0 always the
"slower", while their envs step alike; a slow server's extra time is its envs' (env_p50_ms, above)
or shows as a gap these margins exceed. With many servers the sends add up to a gradient: 256 local
servers on 2 cores measured 67.9 ms (local-0) down to 15.3 ms (local-253), median 42.6 ms, their envs
alike; so a round trip must also stand apart from the next longest (see :func:`_stands_out`)."""


def _stands_out(
    replicas: dict[str, dict[str, Any]], key: str, ratio: float, min_ms: float, *, alone: bool = False
) -> str | None:
    """The server whose ``key`` (a median in ms) is at least ``ratio`` times the other servers' median
    and ``min_ms`` above it; None if none is, or fewer than 2 servers report it. ``alone``: and whose
    excess over that median is mostly its own, the next longest nearer the median than to it (of a
    gradient of round trips that the order of the sends makes, the first is no slower than the second)."""
    values = {a: r[key] for a, r in replicas.items() if r.get(key) is not None}
    if len(values) < 2:
        return None
    slowest = max(values, key=lambda a: values[a])
    others = [v for a, v in values.items() if a != slowest]
    median, value = statistics.median(others), values[slowest]
    if alone and value - max(others) < (value - median) / 2:
        return None
    return slowest if value >= ratio * median and value - median >= min_ms else None


def slowest_line(summary: dict[str, Any]) -> str:
    """The env server the fleet waited for most, against the other servers' median, from the medians
    over the session in summary.json's ``replicas``: the one whose envs step slowest, else the one with
    the longest round trip; "" with fewer than 2 servers, or when none stands out from the others by
    enough that it is not noise or an ordering effect (see SLOWEST_RATIO and SLOWEST_ROUND_TRIP_RATIO)."""
    replicas = {a: r for a, r in (summary.get("replicas") or {}).items() if r.get("latency_p50_ms") is not None}
    slowest = _stands_out(replicas, "env_p50_ms", SLOWEST_RATIO, SLOWEST_MIN_MS) or _stands_out(
        replicas, "latency_p50_ms", SLOWEST_ROUND_TRIP_RATIO, SLOWEST_ROUND_TRIP_MIN_MS, alone=True
    )
    if slowest is None:
        return ""

    def figures(rows: list[dict[str, Any]]) -> str:
        parts = []
        for key, what in (("latency_p50_ms", "round trip"), ("env_p50_ms", "envs' step")):
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                parts.append(f"{what} {statistics.median(values):.2f} ms")
        return ", ".join(parts)

    others = [r for a, r in replicas.items() if a != slowest]
    return (
        f"slowest env server: {slowest} (median {figures([replicas[slowest]])}; "
        f"{'the other server' if len(others) == 1 else f'the other {len(others)} servers'}: median {figures(others)})"
    )


def finished_line(
    run_dir: Path, plot: bool, servers: str | None = None, tls: Sequence[str] = (), down: Collection[str] = ()
) -> str:
    """What a finished run suggests doing next: evaluate its policy (on the running env servers it
    trained on, ``servers``: the envs it stepped, with the kwargs and wrappers it did not record, and
    the only way for an env made outside Python; reached with the TLS options ``tls``, see
    :func:`tls_options`; without those listed that were ``down`` at its end, which eval would fail on),
    and (``plot``: it wrote no plot of its own, though episodes ended) plot its returns."""
    where = shlex.quote(str(run_dir))
    line = f"evaluate its policy with: learner eval {where}"
    left_out = ""
    if servers:
        from learner.discovery import split_addresses  # (grpc-free: the command's start imports no more)

        listed = split_addresses(servers)
        up = [address for address in listed if address not in down] or listed
        if len(up) < len(listed):
            left_out = f" (without {', '.join(a for a in listed if a not in up)}: down at the run's end)"
        line += " " + shlex.join(["--servers", ",".join(up), *tls]) + left_out
    return line + (f"; plot its returns with: learner plot {where}" if plot else "")


def tls_options(config: Args) -> list[str]:
    """The TLS options the run ``config`` reached its servers with, as a command that reaches them again takes
    them (`learner eval` does not take them from the run: without them it would call a TLS proxy's port, say,
    "an HTTP/1 port"). Paths and a name only: a token is the user's to pass again."""
    flags = ["--tls"] if config.tls and config.tls_ca is None else []
    for flag, value in (
        ("--tls-ca", config.tls_ca),
        ("--tls-server-name", config.tls_server_name),
        ("--tls-client-cert", config.tls_client_cert),
        ("--tls-client-key", config.tls_client_key),
    ):
        if value is not None:
            flags += [flag, value]
    return flags


def _resume_command(run_dir: str | Path) -> str:
    """The command that goes on with the run in ``run_dir``."""
    return f"learner train --resume {shlex.quote(str(run_dir))}"


def interrupted_line(run_dir: Path, step: int) -> str:
    """What an interrupted run says, from the checkpoints on disk: a run stopped during an update has
    none of its last update (and, with --checkpoint-every 0, maybe none at all)."""
    checkpoints = list_checkpoints(run_dir)
    resume = _resume_command(run_dir)
    # (train writes the last update's checkpoint when it stops: missing, that write failed, and said why)
    if not checkpoints:
        return f"interrupted at step {step:,}; no checkpoint is on disk: {resume} starts it over"
    if checkpoints[-1] == checkpoint_path(run_dir, step):
        return f"interrupted at step {step:,} (its last update); continue with: {resume}"
    return (
        f"interrupted at step {step:,} (its last update, not checkpointed); continue from its last checkpoint, "
        f"{checkpoints[-1].name}, with: {resume}"
    )


def failed_line(run_dir: str | Path | None) -> str | None:
    """What a run that an error stopped says after the error, where it has a checkpoint to go on from
    (``run_dir``: the run's, None when not known yet): how to, once the cause is mended."""
    if run_dir is None or not Path(run_dir).is_dir() or not (checkpoints := list_checkpoints(run_dir)):
        return None
    return (
        f"once that is mended, continue from its last checkpoint, {checkpoints[-1].name}, with: "
        f"{_resume_command(run_dir)}"
    )


def aborted_line(run_dir: str | Path | None) -> str:
    """What a run aborted by a second Ctrl-C says: the checkpoint a resumed run starts from, if any
    (``run_dir``: the run's, None when not known yet)."""
    if run_dir is None:
        return "aborted"
    if not Path(run_dir).is_dir():
        return "aborted (before the run dir was made)"
    checkpoints = list_checkpoints(run_dir)
    resume = _resume_command(run_dir)
    if not (Path(run_dir) / CONFIG).exists():  # (nothing of the run written yet: --resume would refuse it)
        return f"aborted before anything of the run was written to {run_dir}: run the same command again"
    if not checkpoints:
        return f"aborted; no checkpoint is in {run_dir}: {resume} starts it over"
    return f"aborted; resuming starts from its last checkpoint, {checkpoints[-1].name}, with: {resume}"


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The dataclass fields set on the command line (the parser leaves unset ones out)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string right after a field) of a dataclass, as one line each."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _checked(check: Callable[[Any], Any], prefix: str, convert: Callable[[str], Any] = str) -> Callable[[str], Any]:
    """A type: ``check(convert(text))`` (text that does not convert goes as is, for ``check`` to refuse),
    its ValueError as argparse's error, without the ``prefix: `` that argparse's option name replaces."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = text
        try:
            return check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{prefix}: ")) from None

    return parse


def _video_fps(text: str) -> float:
    from learner.video import check_fps  # (no torch)

    return float(_checked(check_fps, "video_fps", float)(text))


def _gif_path(text: str) -> str:
    from learner.video import check_path

    text = os.path.expanduser(text)  # (see _named_path)
    _checked(check_path, "video")(text)
    return text


def _file_name(suffix: str, what: str, example: str) -> Callable[[str], str]:
    """A type: a path whose file name ends in ``suffix`` (and is more than that)."""

    def parse(text: str) -> str:
        name = Path(text).name.lower()
        if not name.endswith(suffix) or name == suffix:
            raise argparse.ArgumentTypeError(
                f"writes {what}; expected a file name ending in {suffix} (e.g. {example}), got {text!r}"
            )
        return _named_path(text)

    return parse


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return _named_path(text)


def _named_path(text: str) -> str:
    """A type: a path whose names the file system can hold (none over 255 bytes, say), refused otherwise as
    ``PATH: File name too long (...)`` (every path option's type, or its check's: not a traceback at the first
    ``exists()``). A leading ``~`` is the home folder, as the shell makes it where it can: ``--run-dir=~/runs/a``
    (no shell expands a ``~`` after ``=``) made a folder named ``~`` in the working directory."""
    text = os.path.expanduser(text)
    try:
        check_name_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text}: {err}") from None
    return text


_seed = number(0, integer=True)
SERVER_ADDRESS_FORMS = (
    "host:port,host:port, unix:PATH, dns:///name:port (every address of the name), compose:SERVICE, swarm:SERVICE, "
    "file:PATH (the addresses a file lists, read again between rollouts)"
)
_png_path = _file_name(".png", "a PNG", "returns.png")
_sizes = int_list("integers", "64,64")


CONNECTION_OPTIONS = "connections and faults"
"""The title of learner train's options on reaching servers (token, TLS, timeouts) and riding out their faults."""


def _add_dataclass_options(parser: argparse.ArgumentParser, cls: type, groups: dict[str, str]) -> None:
    """One option per field of ``cls`` (``foo_bar`` -> ``--foo-bar``), its docstring as help.

    Unset options stay out of the namespace, so a resumed run can tell what was given from what
    its saved config says.
    """
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    defaults = cls()
    group: argparse._ActionsContainer = parser
    made: dict[str, argparse._ArgumentGroup] = {}  # (a title named again goes on with its group)
    for f in dataclasses.fields(cls):
        if f.name in groups:
            title = groups[f.name]
            if title not in made:
                made[title] = parser.add_argument_group(title)
            group = made[title]
        hint = hints[f.name]
        inner = [a for a in typing.get_args(hint) if a is not type(None)] if _is_optional(hint) else [hint]
        kind = inner[0]
        default = getattr(defaults, f.name)
        help_text = docs.get(f.name, "")
        if default is not None and default != {} and "(default" not in help_text:  # unless it says its own
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            if isinstance(default, bool):
                shown = "on" if default else "off"
            help_text += f" (default: {shown})"
        options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            options["choices"] = list(typing.get_args(kind))
        elif kind in (int, float, str):
            options["type"] = {int: integer, float: real, str: str}[kind]  # (integers also as 1e6)
            if f.name in _PATH_FIELDS:  # (its empty string is Args' to refuse, as from Python)
                options["type"] = _named_path
            options["metavar"] = f.metadata.get("metavar", {int: "N", float: "X", str: "TEXT"}[kind])
        elif typing.get_origin(kind) is tuple:
            options["type"], options["metavar"] = _sizes, "N,N"
        elif typing.get_origin(kind) is dict:
            options["type"], options["metavar"] = json_object_option, "JSON"
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for {hint}")
        group.add_argument(f"--{f.name.replace('_', '-')}", **options)
        if "negatable" in f.metadata:  # an option that is off unless given, which --resume may turn off again
            group.add_argument(
                f"--no-{f.name.replace('_', '-')}",
                dest=f.name,
                action="store_const",
                const=None,
                default=argparse.SUPPRESS,
                help=f"no --{f.name.replace('_', '-')}: {f.metadata['negatable']} (undoes a resumed run's)",
            )


_PATH_FIELDS = frozenset({"run_dir", "resume", "tls_ca", "tls_client_cert", "tls_client_key"})
"""The fields of Args that are paths (--run-dir, --resume, --tls-ca, ...): their options' type is :func:`_named_path`."""


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _presets_epilog() -> str:
    names = list(PRESETS)
    keys = list(PRESETS[names[0]])
    # The rows where the presets differ first; those they share after.
    keys.sort(key=lambda key: len({repr(PRESETS[n][key]) for n in names}) == 1)
    lines = [f"{'preset':<16}" + "".join(f"{n:>12}" for n in names)]
    for key in keys:
        cells = []
        for n in names:
            value = PRESETS[n][key]
            if key == "hidden_sizes" and n == "atari":
                value = "(CNN)"  # image observations get the Nature CNN
            elif isinstance(value, tuple):
                value = ",".join(map(str, value))
            cells.append(
                f"{value:>12,}" if isinstance(value, int) and not isinstance(value, bool) else f"{value!s:>12}"
            )
        lines.append(f"{key:<16}" + "".join(cells))
    return (
        "examples:\n"
        "  learner train --env CartPole-v1 --stop-at-return 475\n"
        "  learner train --env InvertedPendulum-v5 --total-timesteps 300000\n"
        "  learner train --env ALE/Pong-v5 --num-servers 4 --envs-per-server 4 --device cuda\n"
        "  learner train --env CartPole-v1 --servers 10.0.0.5:50051,10.0.0.6:50051\n"
        "  learner train --resume runs/CartPole-v1-20250101-120000 --total-timesteps 200000 --no-stop-at-return\n"
        "  learner train --like runs/CartPole-v1-20250101-120000 --seed 2\n"
        "  learner train --env CartPole-v1 --track --wandb-project-name ppo   # Weights & Biases, as CleanRL\n\n"
        "Hyperparameter presets (--preset auto picks atari for image observations, mujoco for Box actions,\n"
        "classic otherwise; any option given overrides its preset value):\n\n"
        + "\n".join(lines)
        + "\n\nALE ids (ALE/Pong-v5) get the env server's --wrappers atari automatically on the servers\n"
        "this command starts, so 84x84 frame stacks cross the wire (--servers: start them so).\n"
        "Writes to the run dir: config.json, metrics.jsonl (one line per update), TensorBoard events,\n"
        "checkpoints/, summary.json and returns.png (and, with --track, wandb-run.json)."
    )


# -- eval and plot ------------------------------------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> int:
    if (args.run is None) == (args.checkpoint is None):
        args.parser.error(
            "expected a checkpoint file or run dir, as PATH or --checkpoint PATH"
            if args.run is None
            else f"expected one checkpoint, got PATH {args.run} and --checkpoint {args.checkpoint}"
        )
    if args.servers is not None and args.backend == "gym":
        args.parser.error("--servers: evaluates on running env servers, so it cannot go with --backend gym")
    if args.servers is not None and args.num_envs is not None:
        args.parser.error("--num-envs: sets the envs of the local server (or --backend gym); --servers have theirs")
    if (args.servers is not None or args.backend == "gym") and args.transport != DEFAULT_TRANSPORT:
        what = "--servers' addresses say it" if args.servers is not None else "--backend gym has no servers"
        args.parser.error(f"--transport: says how to reach the local env server; {what}")
    if args.backend == "gym" and not args.step_socket:
        args.parser.error("--no-step-socket: says how to reach env servers, so it cannot go with --backend gym")
    if args.video_fps is not None and args.video is None:
        args.parser.error("--video-fps: sets the speed of the GIF that --video PATH.gif writes; give --video too")
    for flag, value in (
        ("--env-kwargs", args.env_kwargs),
        ("--wrappers", args.wrappers),
        ("--max-episode-steps", args.max_episode_steps),
    ):
        if value is not None and args.servers is not None and args.video is None:
            args.parser.error(
                f"{flag}: configures the envs eval makes (a local server, --backend gym, --video's env); with "
                "--servers the running servers decide (set it where they are started)"
            )
    if args.wrappers is not None:
        try:
            check_wrappers(args.wrappers)
        except ValueError as err:
            args.parser.error(str(err))
    token, tls = _connection(args)
    if args.video is not None:
        from learner.video import headless_rendering

        headless_rendering()  # (process-wide, so here: before any env is made, as MuJoCo reads it on import)
    from learner.evaluate import check_seed, evaluate

    _check_device(args, args.device)

    num_envs = 4 if args.num_envs is None else args.num_envs
    try:  # (the envs made here: env i gets seed + i, a 64-bit seed; --servers' number is known once connected)
        check_seed(args.seed, None if args.servers is not None else min(num_envs, args.episodes))
    except ValueError as err:
        args.parser.error(f"--{err}")

    try:
        with _option_terms(args):
            result = evaluate(
                args.run if args.run is not None else args.checkpoint,
                args.episodes,
                servers=args.servers,
                backend=args.backend,
                num_envs=num_envs,
                seed=args.seed,
                device=args.device,
                deterministic=not args.stochastic,
                transport=args.transport,
                step_socket=args.step_socket,
                auth_token=token,
                **tls,
                timeout=args.timeout,
                connect_timeout=args.connect_timeout,
                keepalive_timeout=args.keepalive_timeout,
                video=args.video,
                video_fps=args.video_fps,
                env_kwargs=args.env_kwargs,
                wrappers=args.wrappers,
                progress=args.progress,
                env=args.env,
                max_episode_steps=args.max_episode_steps,
            )
    except _USER_ERRORS as err:
        # The episodes that ended before the error, reported as a result, marked partial (then main says
        # the error, exit 1): as a Ctrl-C's, they are a sample of the return all the same; and the video
        # written before it, which is there all the same. --json: an object whatever the error (a script
        # reads stdout), the error in it.
        error = args.in_option_terms(str(err))
        partial = err.partial_result if isinstance(err, EnvFleetError) else None
        if partial is not None and (partial["episodes"] or "video" in partial or args.json):
            _print_eval_result(args, partial, error=error)
        elif args.json:
            _print_json(args, {"error": error, "exit_status": 1})
        raise
    _print_eval_result(args, result)
    return 130 if result.get("interrupted", False) else 0


def _print_eval_result(args: argparse.Namespace, result: dict[str, Any], error: str | None = None) -> None:
    """``learner eval``'s result: that of every episode asked, or of those finished when a Ctrl-C
    (``interrupted``) or an ``error`` stopped it (its message, as main prints it: then ``--json``'s
    object has it as ``error``)."""
    from learner.stats import format_return, format_returns

    interrupted = result.get("interrupted", False)
    if args.json:
        from learner.rundir import jsonable

        # (valid JSON: NaN and infinities, which json.dumps writes as bare tokens no JSON parser takes, as null)
        # (exit_status in every object, as the command exits: 0, 130 interrupted, 1 an error, 2 usage)
        status = {"exit_status": 1 if error is not None else 130 if interrupted else 0}
        _print_json(args, jsonable({**result, **status} if error is None else {**result, "error": error, **status}))
    else:
        policy = "stochastic" if args.stochastic else "deterministic"
        count = f"{result['episodes']} episode{'' if result['episodes'] == 1 else 's'}"
        if interrupted:
            count = f"interrupted: {count} of {result['episodes_asked']} finished"
        elif error is not None:
            count = f"{result['episodes']} of {result['episodes_asked']} episodes finished before the error,"
        print(f"{result['env']}: {count} of the {policy} policy in {result['checkpoint']}, on {result['envs']}")
        if result["episodes"] == 1:  # (no spread to give)
            print(f"return {format_return(result['return_mean'])}, length {result['length_mean']:.0f}")
        elif result["episodes"]:
            mean, std, low, high = format_returns(*(result[f"return_{k}"] for k in ("mean", "std", "min", "max")))
            print(f"return {mean} +- {std} (min {low}, max {high}), mean length {result['length_mean']:.1f}")
        if "video" in result:
            video = result["video"]
            cut = "" if video["episode_ended"] else ", cut there"
            kept = "" if video["keep_every"] == 1 else f", 1 in {video['keep_every']} frames kept"
            print(
                f"video: {video['path']} (one more episode, in process: {video['steps']:,} steps{cut}, return "
                f"{format_return(video['return'])}; {video['fps']:g} fps{kept})"
            )
        sys.stdout.flush()  # (before the error main prints on stderr)


def _print_json(args: argparse.Namespace, obj: dict[str, Any]) -> None:
    """eval --json's object, one line on stdout, and ``args.json_printed`` set once it is written: then a
    second Ctrl-C adds no object of its own (main prints an abort's where none is: one object on stdout
    however the command ends).

    The object and its newline written whole (:func:`_write_whole`), then the note, with the command's
    signals held (:func:`~learner.interrupts.interrupts_held`): a Ctrl-C (SIGTERM, SIGHUP) that comes
    meanwhile is never between them, where the note would be wrong (set before the write, no object at
    all; after it, two), and is dropped: it came too late to stop anything, and the command ends as its
    object says (``exit_status``). A write that raises all the same (a KeyboardInterrupt of a handler not
    the command's, which may cut a long line's write in the middle) leaves the note unset: main then
    writes the abort's object whole, after what may be part of this one, rather than leave a part (no
    object a parser reads) as all there is. (A stdout that nobody reads holds the signals with the
    write; it held the command before too, at the abort's own object.)"""
    with interrupts_held(drop=True):
        _write_whole(sys.stdout, json.dumps(obj) + "\n")
        args.json_printed = True
        sys.stdout.flush()


def _ascii_compatible(stream: IO[str]) -> bool:
    """Whether ``stream``'s encoding writes ASCII as ASCII (UTF-8, Latin-1; not UTF-16: PYTHONIOENCODING)."""
    try:
        return "{}\n".encode(getattr(stream, "encoding", None) or "") == b"{}\n"
    except (LookupError, TypeError):
        return False


def _write_whole(stream: IO[str], text: str) -> None:
    """Write all of ``text`` (ASCII: json.dumps's) to ``stream``. Unbuffered (PYTHONUNBUFFERED, as the
    images set it) a text stream's write hands the text to the raw file at once, whose write may take only
    part of it (a signal came as it waited for a slow reader), and the rest was dropped: so through the
    binary layer, until all of it is taken."""
    binary = getattr(stream, "buffer", None)
    if binary is None or not _ascii_compatible(stream):  # (a stream of text alone: a StringIO, a notebook's)
        stream.write(text)
        return
    stream.flush()
    data = memoryview(text.encode("ascii"))
    while data:
        taken = binary.write(data)
        if taken is None:  # (a non-blocking file that takes nothing now)
            select.select([], [binary], [])
            taken = 0
        data = data[taken:]
    binary.flush()


def cmd_plot(args: argparse.Namespace) -> int:
    from learner.plot import PlotWriteError, config_groups, plot_runs

    output = Path(args.output or (Path(args.runs[0]) / "returns.png" if len(args.runs) == 1 else "returns.png"))
    if args.output is not None:  # (a run dir that is not one is plot_runs' to name)
        existing = next(p for p in (output, *output.parents) if p.exists())
        if existing == output and output.is_dir():
            args.parser.error(f"-o/--output: {output} is a directory; expected a file name ending in .png")
        if existing != output and not existing.is_dir():
            args.parser.error(f"-o/--output: cannot write {output}: {existing} is a file, not a directory")
    groups = config_groups(args.runs) if args.by_config else None
    try:
        path = plot_runs(args.runs, output, title=args.title, groups=groups, output_name=args.output and "-o/--output")
    except PlotWriteError as err:
        if args.output is not None:  # (its message names -o/--output already)
            raise
        raise ValueError(f"{err}; give -o/--output a path where it can be") from None
    print(f"plot: {path}")
    return 0


def cmd_servers(args: argparse.Namespace) -> int:
    if (args.addresses is None) == (args.servers is None):
        got = "neither" if args.addresses is None else f"both: {args.addresses} and --servers {args.servers}"
        args.parser.error(
            f"expected the servers' addresses, as ADDRESSES or --servers ADDRESSES (one of the two), got {got}"
        )
    if args.servers is None:
        args.servers = args.addresses
    token, tls = _connection(args)
    from learner.survey import describe, survey

    with _option_terms(args):  # (their errors name its options, as train's and eval's do)
        servers = survey(args.servers, timeout=args.timeout, auth_token=token, **tls)
    servers = [dataclasses.replace(s, error=args.in_option_terms(s.error)) for s in servers]
    print(json.dumps([s.to_json() for s in servers]) if args.json else describe(servers))
    return 0 if all(not s.error for s in servers) else 1


# -- bench --------------------------------------------------------------------------------------------------


_env_counts = int_list("numbers of envs")


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names, each once (cartpole-8,cartpole-8 measured it twice)."""
    return tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure remote envs against local vector envs side by side; write JSON, Markdown and a PNG."""
    from learner.benchmarks.run import BenchConfig, check, run_bench

    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        config = BenchConfig(
            out=out,
            suites=_names(args.suites),
            workloads=_names(args.workloads),
            rounds=args.rounds,
            seconds=args.seconds,
            latency_sizes=args.latency_sizes,
            latency_delay_ms=args.latency_delay_ms,
            ppo_env=args.ppo_env,
            ppo_timesteps=args.ppo_timesteps,
            ppo_rounds=args.ppo_rounds,
            ppo_sizes=args.ppo_sizes,
            ppo_layouts=_names(args.ppo_layouts),
            seed=args.seed,
        )
        check(config)
    except ValueError as err:
        args.parser.error(str(err))
    if args.out is None:  # (runs/bench-<time>-2, ... where a bench started in the same second has it)
        try:
            config = dataclasses.replace(config, out=make_new_dir(out))
        except OSError as err:
            args.parser.error(f"--out: cannot make {out}: {os_reason(err)}")
        out = config.out
    elif (out / "bench.json").exists():
        print(f"learner bench: --out {out} holds a bench.json already: this run's results replace it", file=sys.stderr)
    print(f"learner bench: {', '.join(config.suites)} -> {out}", flush=True)
    results = run_bench(config, progress=lambda line: print(line, flush=True), checked=True)
    from learner.benchmarks.report import markdown_tables

    print()
    print(markdown_tables(results))
    interrupted = bool(results["meta"].get("interrupted"))
    if results["meta"].get("unwritten"):  # (a full disk: the tables above are what was measured)
        print("\n".join(f"learner bench: error: {why}" for why in results["meta"]["unwritten"]), file=sys.stderr)
        if interrupted:
            print("learner bench: interrupted; the tables above hold the measurements that finished", file=sys.stderr)
        return 130 if interrupted else 1
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    if interrupted:
        print("learner bench: interrupted; those hold the measurements that finished", file=sys.stderr)
        return 130
    return 0


BENCH_EPILOG = """Everything is measured in one run, in turns: each round steps every vector env of a workload for
--seconds (the order rotates), so load that drifts on a shared machine hits all alike, and ratios
are taken round by round (paired) before their median. Spread = (max - min) / median over the
rounds. A run whose machine was busy says so first: the 1-minute load average was at least its CPU
count at the start, or other tasks kept half its CPUs busy at the end, once the run's own processes
had ended (the load average then still counts the run's own last minute).

Baselines step the very envs the servers build (env_server.envs.make_env: same kwargs and wrappers)
and start through a forkserver, never forked from a process that holds gRPC channels. Remote layouts
run local env servers on Unix sockets, stepped over their step sockets ("grpc": over gRPC's
StepStream; "tcp": loopback TCP and gRPC), waiting awake for the next step as local servers do
(env-server --spin-wait-ms 0.5 when there are no more servers than CPUs; "no spin": never);
"pipelined/G" steps G groups of servers with send/recv; "vec" servers use the env's own vectorized
implementation (--vectorization vector_entry_point: other random streams, so compare it with
make_vec, not with the others).

The latency-bound env is CartPole whose every step takes at least --latency-delay-ms, its own work
included. Envs wait concurrently (each AsyncVectorEnv env in its own process; a server's K envs once
per batched step). Efficiency = env-steps/s / (num_envs / delay); scaling efficiency = env-steps/s /
(num_envs x what one env does alone: AsyncVectorEnv(1) for Async, a 1x1 server for remote layouts),
which the performance target is judged by; both are reported.

Budget (after start-up and a warm-up of up to 0.2 s per vector env): each round steps every vector
env of a workload for --seconds, so a suite takes about --rounds x --seconds x its vector envs.
  throughput  per workload: cartpole-8 11 vector envs, cartpole-64 8, halfcheetah-8 5, pong-8 6
              (~5 minutes at the defaults)
  latency     per size: 2 vector envs for 1 env, 3 up to 8 envs, 4 from 16 (~4 minutes)
  rpc         11 ways to step, --rounds x min(--seconds, 1.0) each (~1 minute)
  ppo         per size in --ppo-sizes, 6 layouts (7 from 8 envs; fewer with --ppo-layouts), --ppo-rounds
              runs each of --ppo-timesteps steps; run r trains with seed r (1..N), whatever --seed
              (~10 minutes)
Latency sizes must split evenly over their layouts' servers (1; even; multiples of 4 from 16), and
PPO sizes too (even; multiples of 4 from 8). With --rounds 1 (--ppo-rounds 1) every figure is one
sample: no spread. The targets name a 2 ms step and CartPole-v1: runs with another
--latency-delay-ms or --ppo-env report those targets as not measured.

examples:
  learner bench                                   # everything (about 20 minutes on 2 cores)
  learner bench --suites throughput --workloads cartpole-8 --rounds 3
  learner bench --suites latency --latency-sizes 16,64
  learner bench --suites ppo --ppo-timesteps 20000
"""


# -- the parser ---------------------------------------------------------------------------------------------


def _add_env_kwargs(parser: argparse.ArgumentParser) -> None:
    """``--env-kwargs`` of the commands that make their env from ``--env`` alone (demo, check)."""
    parser.add_argument(
        "--env-kwargs",
        type=json_object_option,
        default={},
        metavar="JSON",
        help="keyword arguments for the env's constructor, as a JSON object",
    )


def _add_local_server_options(parser: argparse.ArgumentParser, servers: str, sockets: str) -> None:
    """--transport and --step-socket, for commands that start local servers (``train`` has them from Args)."""
    parser.add_argument(
        "--transport",
        choices=["tcp", "unix"],
        default=DEFAULT_TRANSPORT,
        help=f"how to reach the local {servers} (default: %(default)s)",
    )
    parser.add_argument(
        "--step-socket",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"with unix: step over {sockets}, not gRPC (default: on)",
    )


class _Parser(ShortErrorParser):
    """Two-line argument errors (a usage line, as train's takes several, and the error); the top-level
    parser names the commands when none is given.

    ``json_command`` (the top-level parser's: eval): where the command line names that command and asks
    for ``--json``, a usage error (an option's bad value, an unknown option, options that do not go
    together: exit status 2) is also one JSON object on stdout, ``{"error": ..., "exit_status": 2}``, as
    every other way the command ends prints one there (a script reads stdout, and found nothing to parse);
    the usage and the error stay on stderr. The command's own parser's errors (its ``top``: the top-level
    parser) and the top-level parser's, before the command (``learner --log-level bad eval --json``).
    Read from the whole command line, which the top-level parser was handed (:meth:`parse_known_args`
    keeps it), as argparse, failing, leaves no namespace to look in."""

    commands: list[str] | None = None  # (the top-level parser's: named when none is given)
    json_command: str | None = None  # (the top-level parser's)
    top: _Parser | None = None  # (a command's parser whose errors may be objects: the top-level parser)
    _arg_strings: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]  # (typeshed overloads it on the namespace's type)
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._arg_strings = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if self.commands and message == "the following arguments are required: COMMAND":
            message = f"expected a command, one of: {', '.join(self.commands)} (learner COMMAND --help says more)"
        if _asks_for_json(self.top or self):
            print(json.dumps({"error": message, "exit_status": 2}), flush=True)
        super().error(message)


class _Probe(argparse.ArgumentParser):
    """A parser that reads a command line another one refused; its errors raise ArgumentError, an ambiguous
    option's too (argparse's own exits there, whatever ``exit_on_error`` says)."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


def _asks_for_json(top: _Parser) -> bool:
    """Whether the command line that the top-level parser ``top`` was handed (refused, by it or by the
    command's parser) names ``top.json_command`` as its command and holds ``--json``, as argparse reads
    them: an abbreviation of it too (``--js``), not a word after ``--``."""
    if top.json_command is None or _command_of(top, top._arg_strings) != top.json_command:
        return False
    probe = _Probe(add_help=False, exit_on_error=False)
    probe.add_argument("--json", action="store_true")
    try:
        return bool(probe.parse_known_args(list(top._arg_strings))[0].json)
    except argparse.ArgumentError:  # (--json=VALUE: no --json argparse would take)
        return False


def _command_of(top: _Parser, arg_strings: Sequence[str]) -> str | None:
    """The command that ``arg_strings`` name, as the top-level parser ``top`` reads them, whatever the values
    of its options before it (``--log-level bad``: refused, the command after it is read all the same), or
    None. Where argparse cannot read them (an ambiguous option, ``--log``; an option without its value), the
    first word that is a command, before any ``--``."""
    probe = _Probe(add_help=False, exit_on_error=False)
    for action in top._actions:
        if not action.option_strings:  # (the commands: read as top's subparsers read them, below)
            continue
        if action.nargs == 0:  # (--help, --version)
            probe.add_argument(*action.option_strings, dest=action.dest, action="store_true")
        else:
            probe.add_argument(*action.option_strings, dest=action.dest, nargs=action.nargs)
    probe.add_argument("command", nargs=argparse.PARSER)  # (the command, then all after it, as subparsers take)
    try:
        return str(probe.parse_known_args(list(arg_strings))[0].command[0])
    except argparse.ArgumentError:
        words = itertools.takewhile(lambda word: word != "--", arg_strings)
        return next((word for word in words if word in (top.commands or ())), None)


def _add_connection_options(parser: argparse.ArgumentParser, ca_default: str) -> None:
    """--auth-token(-file) and --tls(-ca, -server-name, -client-cert, -client-key), for commands that reach
    running servers (train has its own, from its Args); ``ca_default``: when $ENVFLEET_TLS_CA gives --tls-ca."""
    parser.add_argument(
        "--auth-token",
        default=None,
        metavar="TOKEN",
        help="token for servers started with --auth-token (default: $ENVFLEET_AUTH_TOKEN)",
    )
    parser.add_argument(
        "--auth-token-file",
        default=None,
        type=_named_path,
        metavar="PATH",
        help="... or the file holding it (default: $ENVFLEET_AUTH_TOKEN_FILE)",
    )
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="connect with TLS, verifying with the system's CA roots (default: off)",
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        type=_named_path,
        metavar="PATH",
        help=f"connect with TLS, verifying with this CA file ({ca_default}: $ENVFLEET_TLS_CA)",
    )
    parser.add_argument(
        "--tls-server-name",
        default=None,
        metavar="NAME",
        help="the name in the servers' certificates (default with TLS: $ENVFLEET_TLS_SERVER_NAME; else the host, "
        "the name of a dns:/// address, localhost for unix:PATH)",
    )
    parser.add_argument(
        "--tls-client-cert",
        default=None,
        type=_named_path,
        metavar="PATH",
        help="with TLS: present this client certificate (PEM) to servers that require one (env-server "
        "--tls-client-ca); give --tls-client-key too (default with TLS, when neither is given: "
        "$ENVFLEET_TLS_CLIENT_CERT)",
    )
    parser.add_argument(
        "--tls-client-key",
        default=None,
        type=_named_path,
        metavar="PATH",
        help="the private key (PEM) of --tls-client-cert (default: $ENVFLEET_TLS_CLIENT_KEY, as the certificate)",
    )


def _add_log_options(parser: argparse.ArgumentParser, *, level: str, log_format: str, bar: bool = False) -> None:
    """--log-level and --log-format, with these defaults (argparse.SUPPRESS: none, so that the options
    given after the command override those given before it); ``bar``: for a command with --progress,
    whose help may point to --no-progress (the others refuse it)."""
    format_help = LOG_FORMAT_HELP.format(printed=_PRINTED_WITH_BAR if bar else _PRINTED)
    for flag, default, choices, metavar, help_text in (
        ("--log-level", level, LOG_LEVELS, "LEVEL", LOG_LEVEL_HELP),
        ("--log-format", log_format, LOG_FORMATS, "FORMAT", format_help),
    ):
        parser.add_argument(flag, default=default, type=str.lower, choices=choices, metavar=metavar, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="learner", description="envfleet's learner: drive a fleet of env servers.")
    _add_log_options(parser, level="warning", log_format="text")
    parser.add_argument("--version", action=VersionAction)
    # --log-level and --log-format also after the command (learner train --log-level info), where they
    # override one before.
    common = _Parser(add_help=False)
    _add_log_options(common, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
    common.add_argument("--version", action=VersionAction)
    with_bar = _Parser(add_help=False)  # (the same, for the commands with --progress)
    _add_log_options(with_bar, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS, bar=True)
    with_bar.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="step random actions on local env servers and compare with AsyncVectorEnv",
        description="Start local env servers, step them with random actions through RemoteVectorEnv, and time "
        "that against gymnasium's AsyncVectorEnv with as many envs.",
    )
    demo.add_argument(
        "--env", default="CartPole-v1", metavar="ID", help="gymnasium id or entry point (default: %(default)s)"
    )
    _add_env_kwargs(demo)
    demo.add_argument(
        "--num-servers",
        type=positive_int,
        default=2,
        metavar="N",
        help="local env servers to start (default: %(default)s)",
    )
    demo.add_argument(
        "--envs-per-server", type=positive_int, default=4, metavar="N", help="envs per server (default: %(default)s)"
    )
    demo.add_argument(
        "--steps", type=positive_int, default=3000, metavar="N", help="vector steps to time (default: %(default)s)"
    )
    _add_local_server_options(demo, "servers", "the servers' step sockets")
    demo.add_argument(
        "--seed", type=_seed, default=0, metavar="N", help="seed of the envs and actions (default: %(default)s)"
    )
    demo.set_defaults(func=cmd_demo, parser=demo)

    check = sub.add_parser(
        "check",
        parents=[common],
        help="check your env through a local env server against gymnasium's own vector env",
        description="Build the env as env-server does, run gymnasium's env checker on it, then step it through one "
        "local env server and in-process (gymnasium's SyncVectorEnv) with the same seed and random actions, and "
        "compare what both give; also whether learner train takes its spaces (with which policy and preset), whether "
        "a seeded reset repeats, the step times, and the server's log warnings. Exit status 0 when no check failed (warnings: what survives the wire changed, see the "
        "README's 'Your own env'), 1 when one did.",
        epilog=VECTORIZATION_NOTES,  # (env-server's: what "see below" of --vectorization's help points to)
    )
    check.add_argument("--env", required=True, metavar="ID", help="gymnasium id or entry point (module:Class)")
    _add_env_kwargs(check)
    check.add_argument(
        "--num-envs", type=positive_int, default=2, metavar="N", help="envs on the server (default: %(default)s)"
    )
    check.add_argument(
        "--steps", type=positive_int, default=1000, metavar="N", help="vector steps to compare (default: %(default)s)"
    )
    check.add_argument(
        "--seed", type=_seed, default=0, metavar="N", help="seed of the envs and actions (default: %(default)s)"
    )
    docs = _field_docs(Args)
    check.add_argument(
        "--max-episode-steps", type=positive_int, default=None, metavar="N", help=docs["max_episode_steps"]
    )
    check.add_argument("--wrappers", default="auto", metavar="NAMES", help=docs["wrappers"] + " (default: auto)")
    add_stepping_option(check, "vectorization")  # (as env-server takes them: the modes an operator serves)
    add_stepping_option(check, "autoreset_mode")
    check.add_argument(
        "--hang-timeout",
        type=number(0, unit="seconds"),
        default=HANG_TIMEOUT_S,
        metavar="S",
        help="an env call that runs this many seconds fails the check: on the server (env-server --hang-timeout: a "
        "step or a reset), and in-process (the build and gymnasium's env checker, a reset or a step: their process "
        "is killed); 0: never (default: %(default)g)",
    )
    _add_local_server_options(check, "server", "its step socket")
    check.set_defaults(func=cmd_check, parser=check)

    train = sub.add_parser(
        "train",
        parents=[with_bar],
        help="train PPO on env servers it starts (or --servers, or --backend gym)",
        description=textwrap.dedent(Args.__doc__ or "").strip(),
        epilog=_presets_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_dataclass_options(
        train,
        Args,
        {
            "env": "the envs",
            "auth_token": CONNECTION_OPTIONS,
            "pipeline_groups": "the envs",
            "seed": "the run",
            "eval_every": "evaluation while training (SB3's EvalCallback, RL Zoo's --eval-freq)",
            "track": "tracking with Weights & Biases (CleanRL's --track)",
            "preset": "PPO hyperparameters (unset: the preset's value)",
        },
    )
    # What most runs set first (the envs, the run, where it is tracked), then PPO's hyperparameters; how
    # to reach servers and ride out their faults, which most leave as they are, last.
    groups = train._action_groups
    groups.append(groups.pop(next(i for i, g in enumerate(groups) if g.title == CONNECTION_OPTIONS)))
    # Not an Args field: the token it holds goes into --auth-token (and, like it, never into the run dir).
    connections = next(g for g in train._action_groups if any(a.dest == "auth_token" for a in g._group_actions))
    token_file = connections.add_argument(
        "--auth-token-file",
        default=None,
        type=_named_path,
        metavar="PATH",
        help="read --auth-token from this file, as env-server does (e.g. a mounted secret; surrounding whitespace "
        "is ignored, an empty file refused); not with --auth-token (default: $ENVFLEET_AUTH_TOKEN_FILE)",
    )
    listed = connections._group_actions  # (listed in --help right after --auth-token)
    listed.remove(token_file)
    listed.insert(next(i for i, a in enumerate(listed) if a.dest == "auth_token") + 1, token_file)
    # Not an Args field either: where the options come from, not one of them.
    run_group = next(g for g in train._action_groups if any(a.dest == "resume" for a in g._group_actions))
    like = run_group.add_argument(
        "--like",
        type=_path,
        default=None,
        metavar="RUN",
        help="a new run with the options of the run in RUN (a run dir, or its config.json), from scratch in a run "
        "dir of its own; options given override them (e.g. --seed 2 for another seed). The auth token is never "
        "recorded: give it again where the servers need one; not with --resume",
    )
    listed = run_group._group_actions  # (listed in --help right after --resume)
    listed.remove(like)
    listed.insert(next(i for i, a in enumerate(listed) if a.dest == "resume") + 1, like)
    # (learner bench's: its runs stop if it is killed; as env-server's, not in --help)
    train.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    train.set_defaults(func=cmd_train, parser=train)

    evaluate = sub.add_parser(
        "eval",
        parents=[with_bar],
        help="mean and std return of a checkpoint's deterministic policy",
        description="Run a checkpoint's policy for N episodes on the run's env (local servers unless --servers).",
    )
    evaluate.add_argument(
        "run", nargs="?", type=_path, default=None, metavar="PATH", help="a checkpoint file, or a run dir (its latest)"
    )
    evaluate.add_argument("--checkpoint", type=_path, default=None, metavar="PATH", help="the same as PATH")
    evaluate.add_argument(
        "--episodes", type=positive_int, default=10, metavar="N", help="episodes (default: %(default)s)"
    )
    evaluate.add_argument(
        "--servers",
        default=None,
        metavar="ADDRESSES",
        help=f"running env servers: {SERVER_ADDRESS_FORMS} (default: start one local server)",
    )
    evaluate.add_argument(
        "--env",
        default=None,
        metavar="NAME",
        help="the run's env, named again: needed to make it here (a local server, --backend gym, --video) when it is "
        "module:Name and the run trained on --servers, which named it (envfleet imports no name that came over the "
        "wire unless you give it too)",
    )
    evaluate.add_argument(
        "--env-kwargs",
        type=json_object_option,
        default=None,
        metavar="JSON",
        help="keyword arguments for the constructor of the envs made here (the local server's, --backend gym's, "
        "--video's), as a JSON object, instead of the run's (for a run trained on --servers, those the servers "
        "said they made their envs with; runs of older versions, or on servers too old to say, recorded none, "
        "and eval warns)",
    )
    evaluate.add_argument(
        "--wrappers",
        default=None,
        metavar="NAMES",
        help="comma-separated env-server wrappers for the envs made here, instead of the run's; auto: 'atari' for "
        "ALE ids, none otherwise; none: none",
    )
    evaluate.add_argument(
        "--max-episode-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="a time limit for the envs made here, instead of the run's: for envs without one (CliffWalking, "
        "your own), whose episodes the deterministic policy may never end (an episode that goes on for 10,000 "
        "steps is warned of)",
    )
    evaluate.add_argument(
        "--backend",
        choices=["remote", "gym"],
        default="remote",
        help="remote: env servers; gym: an in-process gymnasium SyncVectorEnv (default: %(default)s)",
    )
    evaluate.add_argument(
        "--num-envs",
        type=positive_int,
        default=None,
        metavar="N",
        help="envs to run the episodes on, locally, at most --episodes (default: 4; with --servers, the servers' envs)",
    )
    _add_local_server_options(evaluate, "server", "the server's step socket")
    _add_connection_options(evaluate, "default with --servers")
    evaluate.add_argument(
        "--timeout",
        type=positive_seconds,
        default=30.0,
        metavar="S",
        help="seconds per call to a server (default: %(default)s)",
    )
    evaluate.add_argument(
        "--connect-timeout",
        type=positive_seconds,
        default=Args.connect_timeout,  # (train's)
        metavar="S",
        help="seconds to wait at the start for --servers to answer (those still building their envs, `compose:` "
        "replicas still starting) (default: %(default)s)",
    )
    evaluate.add_argument(
        "--keepalive-timeout",
        type=positive_seconds,
        default=KEEPALIVE_TIMEOUT,
        metavar="S",
        help="seconds a server has to answer gRPC's keepalive ping (so that one stopped or cut off is noticed "
        "soon); raise it where one answer takes longer to cross the link (default: %(default)s)",
    )
    evaluate.add_argument(
        "--seed", type=_seed, default=0, metavar="N", help="env i gets seed + i (default: %(default)s)"
    )
    evaluate.add_argument(
        "--device",
        type=_checked(check_device, "--device"),
        default="auto",
        metavar="DEVICE",
        help="auto, cpu, cuda or cuda:N (default: %(default)s)",
    )
    evaluate.add_argument("--stochastic", action="store_true", help="sample actions instead of taking the mode")
    evaluate.add_argument(
        "--video",
        type=_gif_path,
        default=None,
        metavar="PATH.gif",
        help="also play one episode on an in-process env of the run (render_mode rgb_array; the env must be "
        "installed here) and write it to PATH.gif",
    )
    evaluate.add_argument(
        "--video-fps",
        type=_video_fps,
        default=None,
        metavar="FPS",
        help="frames per second of the GIF, up to 50 shown as is (above, frames are dropped); default: the "
        "env's render_fps (15 for the atari wrapper: real time)",
    )
    evaluate.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar of the episodes (default: when stderr is a terminal)",
    )
    evaluate.add_argument("--json", action="store_true", help="print the result as one JSON object")
    evaluate.set_defaults(func=cmd_eval, parser=evaluate)
    evaluate.top = parser  # (a usage error of eval --json: an object on stdout too; see _Parser)

    servers = sub.add_parser(
        "servers",
        parents=[common],
        help="what each env server serves, its round trip and who holds it (claims nothing)",
        description="Ask every server ADDRESSES (or --servers) names for its env, spaces, versions, round trip and "
        "the learner that holds it, without claiming it (a training on it goes on undisturbed). Exit status 1 if "
        "any does not answer.",
    )
    servers.add_argument(
        "addresses", nargs="?", default=None, metavar="ADDRESSES", help="the same as --servers ADDRESSES"
    )
    servers.add_argument("--servers", default=None, metavar="ADDRESSES", help=SERVER_ADDRESS_FORMS)
    _add_connection_options(servers, "default")
    servers.add_argument(
        "--timeout",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="seconds each server has to answer (default: %(default)s)",
    )
    servers.add_argument("--json", action="store_true", help="print one JSON list, an object per server")
    servers.set_defaults(func=cmd_servers, parser=servers)

    plot = sub.add_parser(
        "plot",
        parents=[common],
        help="PNG of return against steps and wall time, runs overlaid",
        description="Plot the recent mean return of one or more runs against env steps and wall time.",
    )
    plot.add_argument("runs", nargs="+", type=_named_path, metavar="RUN_DIR", help="run dirs (with metrics.jsonl)")
    plot.add_argument(
        "-o",
        "--output",
        type=_png_path,
        default=None,
        metavar="PATH.png",
        help="PNG to write (default: RUN_DIR/returns.png for one run, else returns.png)",
    )
    plot.add_argument("--title", default=None, help="figure title (default: the env ids)")
    plot.add_argument(
        "--by-config",
        action="store_true",
        help="one line per configuration, not per run: runs whose config.json differ only in --seed (and in what "
        "does not change learning: run dir, --stop-at-return, timeouts; --total-timesteps where nothing anneals "
        "over it) are drawn as their mean where all have points, their range shaded, each labelled by what sets it "
        "apart from the others (e.g. num_envs=8 against num_envs=64)",
    )
    plot.set_defaults(func=cmd_plot, parser=plot)

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="remote envs against SyncVectorEnv, AsyncVectorEnv and SB3 SubprocVecEnv, side by side",
        description="Measure env-steps/s of RemoteVectorEnv layouts against local vector envs with the same\n"
        "total envs (CartPole, HalfCheetah, Pong), a latency-bound env from 1 to 64 envs, PPO end to end\n"
        "(learner train) and the cost of one round trip; write bench.json, bench.md and bench.png.",
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--out",
        type=_named_path,
        default=None,
        metavar="DIR",
        help="output dir (default: runs/bench-<time>, a new folder)",
    )
    bench.add_argument(
        "--suites",
        default="throughput,latency,rpc,ppo",
        metavar="NAMES",
        help="what to measure: throughput, latency, rpc, ppo (default: %(default)s)",
    )
    bench.add_argument(
        "--workloads",
        default="cartpole-8,cartpole-64,halfcheetah-8,pong-8",
        metavar="NAMES",
        help="throughput workloads (default: %(default)s)",
    )
    bench.add_argument(
        "--rounds",
        type=integer,
        default=5,
        metavar="N",
        help="rounds of the throughput, latency and rpc suites: each gives every vector env one sample "
        "(default: %(default)s)",
    )
    bench.add_argument(
        "--seconds",
        type=positive_seconds,
        default=2.0,
        metavar="S",
        help="seconds per vector env per round, > 0 (the rpc suite: at most 1.0; default: %(default)s)",
    )
    bench.add_argument(
        "--latency-sizes",
        type=_env_counts,
        default=(1, 2, 4, 8, 16, 32, 64),
        metavar="N,N",
        help="numbers of envs for the latency-bound env (default: 1,2,4,8,16,32,64)",
    )
    bench.add_argument(
        "--latency-delay-ms",
        type=number(0, above=True, unit="milliseconds"),
        default=2.0,
        metavar="MS",
        help="its step time, > 0 (default: %(default)s)",
    )
    bench.add_argument(
        "--ppo-env", default="CartPole-v1", metavar="ID", help="env of the ppo suite's runs (default: %(default)s)"
    )
    bench.add_argument(
        "--ppo-timesteps",
        type=integer,
        default=50_000,
        metavar="N",
        help="env steps per training run (default: %(default)s)",
    )
    bench.add_argument(
        "--ppo-rounds",
        type=integer,
        default=3,
        metavar="N",
        help="runs per layout; run r trains with seed r, whatever --seed (default: %(default)s)",
    )
    bench.add_argument(
        "--ppo-sizes", type=_env_counts, default=(8, 64), metavar="N,N", help="total envs (default: 8,64)"
    )
    bench.add_argument(
        "--ppo-layouts",
        default=",".join(PPO_LAYOUTS),
        metavar="NAMES",
        help="the ppo suite's layouts: gym (in-process SyncVectorEnv, what the PPO target compares with); "
        "2 local servers over tcp, over grpc on Unix sockets, on their step sockets (unix), pipelined in 2 "
        "groups (pipelined); 1-server; 4-servers (pipelined, from 8 envs) (default: %(default)s)",
    )
    bench.add_argument(
        "--seed",
        type=_seed,
        default=0,
        metavar="N",
        help="seed of the throughput and latency suites' resets and random actions (default: %(default)s)",
    )
    bench.set_defaults(func=cmd_bench, parser=bench)
    parser.commands = list(sub.choices)
    parser.json_command = "eval"  # (its usage errors, before the command too, under --json: an object too)
    return parser


# -- the library's advice in the commands' terms -----------------------------------------------------------


def _option_hints(command: str) -> list[tuple[str, str]]:
    """The advice of the library's errors and log lines that names its arguments, and what ``learner
    COMMAND`` (train, eval, servers) says instead, naming its options: they are what its users can
    raise (in order: a pair may word what an earlier one gave). Eval words its errors as evaluate()
    does first (:data:`learner.evaluate.OWN_TERMS`: its --timeout is the resets' deadline too, and it
    stops at an env's error). Imports the library, so grpc: call it where the command has done so (before,
    :func:`prefer_fast_grpc_core` comes first)."""
    from learner.client import KEEPALIVE_TIMEOUT_HINT, RESET_TIMEOUT_HINT, TIMEOUT_HINT
    from learner.remote import FAULT_TOLERANT_HINT

    hints: list[tuple[str, str]] = []
    if command == "eval":
        from learner.evaluate import OWN_TERMS

        hints += OWN_TERMS
    hints += [
        (TIMEOUT_HINT, TIMEOUT_HINT.replace("`timeout`", "--timeout")),
        # (the TLS hints of learner.discovery name the argument, then train's option: the option alone;
        # RemoteVectorEnv's, the argument alone)
        ("tls=..., learner train --tls-ca", "--tls-ca"),
        ("tls=PATH, learner train --tls-ca", "--tls-ca"),
        ("tls_server_name=NAME, learner train --tls-server-name", "--tls-server-name NAME"),
        (
            "tls_client_cert=PATH, tls_client_key=PATH; learner train --tls-client-cert PATH --tls-client-key PATH",
            "--tls-client-cert PATH --tls-client-key PATH",
        ),
        ("or tls_server_name)", "or --tls-server-name)"),
        ("(tls_client_cert, tls_client_key)", "(--tls-client-cert, --tls-client-key)"),
    ]
    if command in ("train", "eval"):
        hints += [
            # ("raise `keepalive_timeout`, --keepalive-timeout, ...": the option alone)
            (KEEPALIVE_TIMEOUT_HINT, KEEPALIVE_TIMEOUT_HINT.replace("`keepalive_timeout`, ", "")),
            # (servers not answering yet, still building their envs)
            ("`connect_timeout`", "--connect-timeout"),
            # (local servers that did not listen in time: learner.local's, which names both)
            ("raise startup_timeout; learner train and eval: --connect-timeout", "raise --connect-timeout"),
        ]
    if command == "train":
        hints += [
            (RESET_TIMEOUT_HINT, RESET_TIMEOUT_HINT.replace("`reset_timeout`", "--reset-timeout")),
            # (said only with --no-fault-tolerant: the rollout is dropped, every env starting over)
            (FAULT_TOLERANT_HINT, "with --fault-tolerant, the default, only this env's episode would be cut short"),
        ]
    return hints


def _reworded(text: str, hints: Sequence[tuple[str, str]]) -> str:
    """``text`` with each of ``hints``' library phrases replaced by the command's."""
    for library, command in hints:
        text = text.replace(library, command)
    return text


class _OptionTerms(logging.Filter):
    """Rewords a log record's message with :func:`_reworded` (the servers lost, still down, a rollout
    dropped: logged by the library, with its advice). A filter of the handlers, as one of a logger
    sees only that logger's own records, not those of the loggers below it."""

    def __init__(self, hints: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self.hints = hints

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # (a malformed call: logging reports it as it formats the record, as without us)
            return True
        reworded = _reworded(message, self.hints)
        if reworded != message:
            record.msg, record.args = reworded, None
        return True


@contextlib.contextmanager
def _option_terms(args: argparse.Namespace) -> Iterator[None]:
    """While the block runs (the command's library call), the log lines name ``args.command``'s options
    where the library's advice names its arguments (:func:`_option_hints`); after it, the error main
    prints does too (``args.in_option_terms``, which the command may use for what it prints itself).
    The console handlers that stand in for the root logger's while a progress bar is up take their
    filters, this one included."""
    hints = _option_hints(args.command)
    args.in_option_terms = lambda text: _reworded(text, hints)
    handlers = list(logging.getLogger().handlers)
    terms = _OptionTerms(hints)
    for handler in handlers:
        handler.addFilter(terms)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(terms)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``learner`` command on ``argv`` (default: the process's), as a function: its exit status."""
    return _command(argv, then_exit=False)


def _command(argv: Sequence[str] | None, *, then_exit: bool) -> int:
    started = time.monotonic()
    try:
        return _run_command(argv, then_exit=then_exit)
    finally:
        _linger(started)


def _linger(since: float) -> None:
    """Once the command has said all it had to: wait for the metrics endpoints that --metrics-linger serves on
    after the end of its run (one that ended after ``since``, time.monotonic(); a Ctrl-C ends the wait)."""
    if "learner.live_metrics" not in sys.modules:  # (no endpoint served: not imported for nothing)
        return
    from learner.live_metrics import lingering, wait_for_lingering

    for url, left in lingering(since):
        print(
            f"learner: serving the run's last metrics on {url} for {left:.0f} s more (--metrics-linger; Ctrl-C "
            "stops it now)",
            file=sys.stderr,
            flush=True,
        )
    wait_for_lingering(since)


def _run_command(argv: Sequence[str] | None, *, then_exit: bool) -> int:
    prefer_fast_grpc_core()  # first: before anything imports grpc
    try:
        args, unknown = build_parser().parse_known_args(argv)
    except KeyboardInterrupt:  # (building the parser imports gymnasium: a second or so)
        note_ctrl_c()  # (ended by it, as later: see run)
        print("learner: aborted", file=sys.stderr)
        return 130
    if unknown:  # said by the command's parser, whose usage names the command
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.log_level, args.log_format)
    if then_exit:  # (the command's process only, not main()'s caller: about 5 file descriptors per env server,
        # which a soft limit of 256 or 1024 runs out of long before the hard limit does)
        raise_fd_limit()
        _find_modules_here()
    _warn_of_unread_variables()
    try:
        # (SIGTERM, SIGHUP: as Ctrl-C, where train or eval do not take them)
        with ending_as_interrupt(then_exit=then_exit):
            return _interrupt_unwrapped(args.func, args)
    except _USER_ERRORS as err:
        # (train's, eval's and servers' advice names their options, not the library's arguments: _option_terms)
        reword: Callable[[str], str] = getattr(args, "in_option_terms", str)
        notes = [f"\n  {reword(note)}" for note in getattr(err, "__notes__", ())]  # e.g. the other servers' errors
        _say_end(args, f"error: {reword(str(err))}{_way_out(err)}{''.join(notes)}")
        return 1
    except OSError as err:
        # (out of file descriptors wherever it struck, an import's file included: said as such, not a traceback)
        if (fds := out_of_fds(err)) is None:
            raise
        message = f"{fds} ({err})"
        if args.command == "eval" and args.json and not getattr(args, "json_printed", False):
            _print_json(args, {"error": message, "exit_status": 1})  # (one object however it ends)
        _say_end(args, f"error: {message}")
        return 1
    except ModuleNotFoundError as err:
        missing = (err.name or "").partition(".")[0]
        if missing == "wandb":  # (learner train --track, or a resumed run that was tracked)
            _say_end(
                args,
                "error: --track needs wandb, which is not installed here: pip install "
                "'envfleet[track]' (from a clone: pip install -e '.[track]'; the learner image: build it with the "
                "extra, ENVFLEET_LEARNER_EXTRAS=track docker compose build learner), or train without --track (a "
                "resumed run that was tracked: --no-track)"
                + ("; $ENVFLEET_TRACK turns it on here" if getattr(args, "tracked_by_variable", False) else ""),
            )
            return 1
        if missing not in _LEARNER_EXTRA:
            raise
        _say_end(args, f"error: needs {missing}, which is not installed here: {install_hint(missing)}")
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops training at the next step)
        if args.command == "eval" and args.json and not getattr(args, "json_printed", False):
            # (eval --json prints one object however it ends: aborted too, before it had a result to print)
            _print_json(args, {"error": "aborted", "exit_status": 130})
        _say_end(args, "aborted")
        return 130


def _interrupt_unwrapped(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``, a KeyboardInterrupt that Python 3.11 wrapped raised as itself: a Ctrl-C's, raised as a
    class was made (a dataclass field's ``__set_name__``, as the command imported its module: learner.train's, a
    second into ``learner train``), came out as ``RuntimeError: Error calling __set_name__ on 'Field' instance ...``,
    and the command ended in a traceback, status 1, not ``aborted``, 130 (1 of 60 Ctrl-Cs in a fuzz; 3.12 no longer
    wraps it)."""
    try:
        return int(command(args))
    except RuntimeError as err:
        if isinstance(err.__cause__, KeyboardInterrupt):
            raise err.__cause__ from None
        raise


def _say_end(args: argparse.Namespace, text: str) -> None:
    """Say why the command ends, on stderr: ``learner COMMAND: TEXT`` (``error: ...``, ``aborted...``), or
    under ``--log-format json`` one record (logger learner.cli, level ERROR, an abort's too: shown whatever
    --log-level) whose message is TEXT without its ``error: ``, as env-server says its own: the line a log
    collector most needs (why the process exited) is then one it parses, with a time and a level, as the
    command's other lines. (Usage errors, exit status 2, stay argparse's two lines, said before logging is set
    up.)"""
    if getattr(args, "log_format", "text") != "json":
        print(f"learner {args.command}: {text}", file=sys.stderr)
        return
    logging.getLogger("learner.cli").error("%s", text.removeprefix("error: "))


def _find_modules_here() -> None:
    """The working directory on sys.path, last (behind the installed packages: a clone's files shadow
    none), where the command's script left it out: ``--env mymodule:MyEnv`` is then found for the envs
    made in this process (``--backend gym``, eval's ``--video``) as the servers it starts find it
    (env-server adds it) and as ``python -m learner`` has it."""
    try:
        here = os.getcwd()
    except OSError:  # (a working directory removed since)
        return
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def _warn_of_unread_variables() -> None:
    """Warn of each set ENVFLEET_* variable no envfleet command reads (a typo of ENVFLEET_TLS_CA, say), as
    env-server does at its start: the names are env_server.variables' and env-server's options'."""
    from env_server.__main__ import server_variables
    from env_server.variables import unread_variables

    for warning in unread_variables(os.environ, server_variables()):
        logging.getLogger("learner.cli").warning("%s", warning)


def _way_out(err: BaseException) -> str:
    """What to do about an error whose own words do not say (appended to them), else ""."""
    if isinstance(err, FileNotFoundError) and (err.strerror or "").startswith("No usable temporary directory"):
        # (tempfile's: no writable temporary folder, as in a container with a read-only root; local servers'
        # sockets and torch's import need one)
        return " (set TMPDIR to a writable directory, or mount a tmpfs on /tmp: docker run --tmpfs /tmp)"
    return ""


def run() -> NoReturn:
    """The ``learner`` command and ``python -m learner``: the command, as :func:`main` runs it, then the
    process's exit, not broken by a repeated signal after one that stopped the command (its handlers go
    straight to ignored: :func:`learner.progress.ending_as_interrupt`'s ``then_exit``).

    Stopped by Ctrl-C, the process ends as one that Ctrl-C killed (status 130 to a shell, -2 to
    Python's subprocess), as Python does with a KeyboardInterrupt nothing caught: its exit hooks run,
    then it ends by SIGINT. A shell running it in a loop then stops the loop as well: bash goes on
    after a Ctrl-C that its command exited from (even with 130), taking it as handled there ("wait and
    cooperative exit"), and stops where the command died of it.

    A closed stdout (``learner servers | head -1``) ends it with status 1 and no traceback, as Python's
    docs advise (``head`` has what it wanted)."""
    from env_server.__main__ import usable_stdio  # (no grpc)

    usable_stdio()  # (a closed stdout or stderr: os.devnull; an encoding short of a path's letters: escapes)
    try:
        status = _command(None, then_exit=True)
        sys.stdout.flush()  # (here, where a closed pipe can be told: at the exit it prints "Exception ignored")
    except BrokenPipeError:
        if not _stdout_closed():  # (another pipe's or socket's: an error as any other)
            raise
        # stdout pointed at /dev/null: the interpreter's last flush at its exit would fail again.
        to_devnull(sys.stdout.fileno())
        sys.exit(1)
    if status == 130 and stopped_by_ctrl_c():
        sys.excepthook = _silent_interrupt  # (the command has said how it stopped: no traceback)
        raise KeyboardInterrupt
    sys.exit(status)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR; False where it cannot tell)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # (no poll(), as on Windows; stdout without a descriptor)
        return False


def _silent_interrupt(kind: type[BaseException], error: BaseException, tb: types.TracebackType | None) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, tb)


if __name__ == "__main__":
    run()
