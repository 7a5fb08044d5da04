"""Training configuration: ``Args`` (what ``learner train`` is given) and the PPO presets it resolves to.

No torch here: the CLI builds ``learner train --help`` from these dataclasses without loading it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

import gymnasium as gym

from env_server.protocol import KEEPALIVE_TIMEOUT
from learner.discovery import AddressError, check_written, split_addresses
from learner.local import DEFAULT_TRANSPORT

__all__ = [
    "DEFAULT_ENV",
    "DEFAULT_WANDB_PROJECT",
    "LOCAL_SERVER_OPTIONS",
    "METRICS_HOST",
    "NO_TLS",
    "PRESETS",
    "SESSION_OPTIONS",
    "Args",
    "check_device",
    "PPOConfig",
    "default_run_dir",
    "pick_preset",
    "resolve_ppo",
    "type_error",
]

Preset = Literal["auto", "classic", "mujoco", "atari"]

DEFAULT_ENV = "CartPole-v1"
"""The env ``learner train`` starts servers for when --env is not given."""

MAX_SEED = 2**32 - 1
"""The largest --seed: NumPy's global generator (numpy.random.seed) takes no larger."""


METRICS_HOST = "127.0.0.1"
"""Where ``learner train --metrics-port`` serves unless --metrics-host says otherwise (env-server's --host
default)."""

DEFAULT_WANDB_PROJECT = "envfleet"
"""The W&B project ``learner train --track`` logs to unless --wandb-project-name (or $WANDB_PROJECT) says
otherwise (CleanRL's is "cleanRL")."""

SESSION_OPTIONS: dict[str, Any] = {
    "progress": None,
    "metrics_port": None,
    "metrics_host": METRICS_HOST,
    "metrics_linger": 0.0,
}
"""Options (and their unset values) of one session of a run, not of the run: a run resumed or repeated
(--resume, --like) takes this session's, not those its config.json recorded."""

LOCAL_SERVER_OPTIONS: dict[str, Any] = {
    "num_envs": None,
    "envs_per_server": None,
    "env_kwargs": {},
    "step_delay_ms": 0.0,
    "max_episode_steps": None,
    "hang_timeout": None,
    "wrappers": "auto",
}
"""Options (and their unset values) that configure the env servers ``learner train`` starts: with
--servers, the running servers decide them."""


@dataclass(frozen=True)
class Args:
    """Train PPO on a fleet of env servers (started locally unless --servers is given)."""

    # -- the envs -------------------------------------------------------------------------------------------
    env: str | None = field(default=None, metadata={"metavar": "ID"})
    """gymnasium id or package.module:Factory entry point (default: CartPole-v1; with --servers, the
    env the servers serve, which a given --env must match). ALE ids (ALE/Pong-v5) get the env
    server's 'atari' wrappers (84x84 grayscale, frame skip 4, 4-frame stack) on the servers this command
    starts (--servers: start them with --wrappers atari), and the Nature CNN"""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments for the env's constructor, as a JSON object, for the servers this command starts
    (or --backend gym's envs); with --servers, set them where the servers are started"""
    servers: str | None = field(default=None, metadata={"metavar": "ADDRESSES"})
    """running env servers to train on: host:port,host:port, unix:/path, dns:///name:port,
    compose:SERVICE (every replica of a Docker Compose service), swarm:SERVICE (every task of a
    Docker Swarm service) or file:PATH (the addresses a file lists); looked up again between rollouts;
    without it, local env servers are started as subprocesses"""
    backend: Literal["remote", "gym"] = "remote"
    """remote: env servers (over gRPC; steps on their step sockets when reached over Unix sockets);
    gym: an in-process gymnasium SyncVectorEnv of the same size and wrappers (for side-by-side
    comparisons)"""
    num_servers: int = 2
    """local env servers to start"""
    envs_per_server: int | None = None
    """envs per local server (default: 4, or --num-envs / --num-servers)"""
    num_envs: int | None = None
    """total envs when servers are started locally (split evenly over --num-servers)"""
    transport: Literal["tcp", "unix"] = DEFAULT_TRANSPORT
    """how to reach local servers: Unix domain sockets (steps then go over each server's step socket,
    see --step-socket) or loopback TCP"""
    step_socket: bool = True
    """step servers reached over Unix sockets (local ones, unix: addresses) over their step socket: the
    same messages as gRPC's StepStream without HTTP/2, a few times cheaper per step; --no-step-socket
    keeps every step on gRPC (for comparisons)"""
    wrappers: str = field(default="auto", metadata={"metavar": "NAMES"})
    """comma-separated env-server wrappers for the servers this command starts; auto: 'atari' for
    ALE ids, none otherwise; none: none"""
    step_delay_ms: float = field(default=0.0, metadata={"metavar": "MS"})
    """make every env step take this many ms longer (passed to the servers this command starts)"""
    max_episode_steps: int | None = field(default=None, metadata={"metavar": "N"})
    """end every episode after N steps at most, as truncated (env-server --max-episode-steps, for the
    servers this command starts): for --env module:Class envs, which have no time limit otherwise"""

    # -- connections and faults (listed last in --help: learner.cli's groups start at these fields) ---------
    auth_token: str | None = field(default=None, metadata={"metavar": "TOKEN"})
    """token for servers started with --auth-token (default: $ENVFLEET_AUTH_TOKEN; or see
    --auth-token-file); local servers this command starts require it too. Never written to the run dir:
    give it again with --resume"""
    tls: bool = False
    """connect to the servers with TLS, verifying their certificates with the system's CA roots"""
    tls_ca: str | None = field(default=None, metadata={"metavar": "PATH"})
    """connect with TLS, verifying the servers' certificates with the CA certificate(s) in this PEM file
    (default with --servers: $ENVFLEET_TLS_CA, as env-server's health probe takes it)"""
    tls_server_name: str | None = field(default=None, metadata={"metavar": "NAME"})
    """the name the servers' certificates hold, when it is not the host in their addresses (default with
    TLS: $ENVFLEET_TLS_SERVER_NAME; else the host, the name of a dns:/// address, localhost for unix:PATH)"""
    tls_client_cert: str | None = field(default=None, metadata={"metavar": "PATH"})
    """with TLS: present this client certificate (PEM) to servers that require one (env-server
    --tls-client-ca); give --tls-client-key too (default with TLS, when neither is given:
    $ENVFLEET_TLS_CLIENT_CERT). Recorded in the run dir as a path, for --resume"""
    tls_client_key: str | None = field(default=None, metadata={"metavar": "PATH"})
    """the private key (PEM) of --tls-client-cert (default: $ENVFLEET_TLS_CLIENT_KEY, as the certificate);
    only its path is recorded"""
    connect_timeout: float = field(default=10.0, metadata={"metavar": "S"})
    """seconds to wait at the start for --servers to answer, and for their names to resolve
    (`dns:` names with no server ready yet, `compose:` replicas still starting): raise it where
    servers take a while to come up (Kubernetes pods: minutes); also how long the local servers
    this command starts (without --servers) may take to build their envs, 60 s at least"""
    timeout: float = field(default=10.0, metadata={"metavar": "S"})
    """seconds each call to an env server may take (fault-tolerant: then the server counts as lost, and
    the other envs step on); raise it for envs whose batched step or reset can take longer"""
    keepalive_timeout: float = field(default=KEEPALIVE_TIMEOUT, metadata={"metavar": "S"})
    """seconds a server has to answer gRPC's keepalive ping (sent after 10 s without one), so that a server
    that stopped or was cut off is noticed within ~15 s; the answer waits behind the data the server
    sends, so raise it where one answer takes longer to cross the link (big observations, slow link)"""
    reset_timeout: float | None = field(default=None, metadata={"metavar": "S"})
    """seconds a reset may take, where it takes longer than a step (a level to load): resets, and the
    steps in which envs autoreset (the step after an episode ended), get this deadline, other steps
    keep --timeout's, so a hung server is still noticed soon (default: --timeout)"""
    fault_tolerant: bool = True
    """keep training when env servers fail: their envs' episodes end as truncated, their steps stay
    out of the batch, and they rejoin with new episodes once their server is back (reconnecting
    with backoff); --no-fault-tolerant: a failed step drops the whole rollout and its server leaves
    the fleet until it answers again (the run stops after 3 such rollouts in a row). Either way, 3
    rollouts in a row in which no env gives a transition (every env raises, say) stop the run with an
    error naming the envs' errors"""
    give_up_after: float = field(default=60.0, metadata={"metavar": "S"})
    """fault-tolerant: stop with an error once every env server has been unavailable this many seconds"""
    hang_timeout: float | None = field(default=None, metadata={"metavar": "S"})
    """the servers this command starts exit once an env call (a step or a reset) has run this many
    seconds, and are started again, their envs rejoining (env-server --hang-timeout); 0: never (default:
    60, or twice --timeout or --reset-timeout where more)"""

    # -- the envs, again ------------------------------------------------------------------------------------
    pipeline_groups: int = 1
    """send/recv pipelining: the servers form this many groups, and each group steps while the
    learner computes the next group's actions (1: all servers step together; at most one group per
    server)"""

    # -- the run --------------------------------------------------------------------------------------------
    seed: int = 1
    """seed of the agent, the sampling and the envs (env i gets seed + i)"""
    total_timesteps: int | None = None
    """env steps to train for, over all envs (default: the preset's), rounded up to whole rollouts of
    --num-steps x the number of envs (20,000 with 8 envs x 32 steps: 79 rollouts, 20,224 steps)"""
    stop_at_return: float | None = field(default=None, metadata={"negatable": "train on to --total-timesteps"})
    """stop once the mean return of the last 20 finished episodes is at least this (inf: never, as
    --no-stop-at-return); also the bar the run counts as solved at (summary.json's solved_at_step).
    Unset: train on to --total-timesteps, "solved" judged by the env's registered reward_threshold
    (CartPole-v1: 475), if it has one"""
    run_dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """where metrics, TensorBoard events, config, checkpoints and summary go (default: runs/<env>-<date>-<time>)"""
    resume: str | None = field(default=None, metadata={"metavar": "RUN_DIR"})
    """continue the run in this run dir from its last checkpoint (its config, unless overridden), or from a
    checkpoint of its checkpoints/ folder (RUN_DIR/checkpoints/step-N.pt: the newer ones are set aside as
    *.abandoned). A run trained on --servers goes on on them, or on other --servers; given --backend, --num-servers, --num-envs
    or --envs-per-server, on envs this command starts: the same env, as many envs unless given, with the
    servers' wrappers, time limit and env kwargs as recorded (runs of older versions: add their --env-kwargs,
    older still their --wrappers and --max-episode-steps too)"""
    checkpoint_every: int = 1
    """write a checkpoint every this many updates, once --checkpoint-seconds have passed since the last
    one (also at the end and on Ctrl-C); 0: only then. A checkpoint costs ~3 ms for an MLP, ~60 ms for
    the Atari CNN"""
    checkpoint_seconds: float = field(default=30.0, metadata={"metavar": "S"})
    """at least this many seconds between checkpoints (the end and Ctrl-C write one regardless): a learner
    killed at any moment loses at most this much training, or the update in progress, when resumed;
    0: after every --checkpoint-every updates (CartPole's fast updates then write ~2.7 GB an hour)"""
    keep_checkpoints: int = 3
    """how many of the latest checkpoints to keep"""
    save_best: bool = True
    """also keep checkpoints/best.pt: the nets after the update whose rollout ended with the highest mean
    return of the last 20 episodes so far (judged once 20 have ended; rewritten at each new best)"""
    device: str = field(default="auto", metadata={"metavar": "DEVICE"})
    """auto (cuda when available), cpu, cuda or cuda:N: rollout storage, inference and updates"""
    overlap_update: bool = False
    """update the nets on a background thread while a copy of them collects the next rollout (a policy
    lag of one update, the ratios taken against the policy that acted): for slow envs, where the envs'
    stepping can hide the update. A resumed run collects again, with the updated nets, the rollout
    that was waiting for the last checkpointed update or in progress"""
    torch_threads: int = 0
    """torch CPU threads; 0: 1 for MLPs on the CPU (faster for small nets), torch's default otherwise (at most
    the CPUs this process may use, a container's --cpus quota, unless OMP_NUM_THREADS is set)"""
    torch_deterministic: bool = True
    """cudnn.deterministic: reproducible convolutions on CUDA"""
    progress: bool | None = None
    """show a progress bar (default: when stderr is a terminal or in a Jupyter notebook; otherwise a line on
    stdout every 60 s, for logs: steps, SPS, mean return)"""
    tensorboard: bool = True
    """write TensorBoard event files (CleanRL's tag names)"""
    replica_metrics: Literal["auto", "all", "summary"] = "auto"
    """each env server's figures (replicas/<server>/...: round trips, envs' step time, times lost, stalls) in
    metrics.jsonl and TensorBoard: all (every update), summary (only in the updates the server was down,
    lost, back, stalled or slow in; the fleet's figures, fleet/..., are in every row either way), auto: all for a
    session that starts with up to 16 servers, summary for more. --metrics-port gives every server's"""
    plot: bool = True
    """write returns.png (return against steps and wall time) into the run dir at the end"""
    metrics_port: int | None = field(default=None, metadata={"metavar": "PORT"})
    """serve Prometheus metrics (progress, SPS, returns, losses, the time of the last update, the fleet's
    faults, each env server's latency and load, the process's CPU and memory) at
    http://HOST:PORT/metrics (HOST: --metrics-host) from the moment the command starts (while its env
    servers start too) until the run ends; 0 picks a free port (logged, and printed with the run dir).
    A run resumed or repeated (--resume, --like) serves none unless given it again"""
    metrics_host: str = field(default=METRICS_HOST, metadata={"metavar": "HOST"})
    """interface --metrics-port listens on, as env-server's --host; 0.0.0.0 for all (in a container, for
    Prometheus to scrape it)"""
    metrics_linger: float = field(default=0.0, metadata={"metavar": "S"})
    """go on serving --metrics-port for this many seconds after the run's end (not after a Ctrl-C; a Ctrl-C
    ends the wait), for Prometheus to scrape its last values (the steps, solved, the end's time and reason:
    the endpoint closes ~2 s after the last update otherwise); 0: close at once. The learner command waits for
    it; a Python program that calls train() serves it while it lives (learner.live_metrics.wait_for_lingering()
    waits)"""

    # -- evaluation while training (SB3's EvalCallback, RL Zoo's --eval-freq) ---------------------------------
    eval_every: int = field(default=0, metadata={"metavar": "N"})
    """evaluate the current policy every N env steps (at the first update at or past each multiple of N, and
    once more at the run's last update, --total-timesteps reached, if any ran, or --stop-at-return met, unless
    that update was): --eval-episodes episodes of its
    deterministic policy (the mode, as learner eval), --norm-obs statistics applied but not updated, raw env
    returns (no --clip-reward or --norm-reward), on envs of their own (an extra local env server; --backend
    gym: in process; --servers: --eval-servers), seeded apart from training's; training goes on exactly as
    without it. metrics.jsonl's eval/* columns, TensorBoard's eval/mean_reward, summary.json's
    best_eval_return and checkpoints/best-eval.pt record them; one cut short by a Ctrl-C (or, at the run's end, a
    kill) is played first by --resume; 0: never"""
    eval_episodes: int = field(default=10, metadata={"metavar": "N"})
    """episodes per evaluation (--eval-every), shared out over the --eval-envs as learner eval does"""
    eval_envs: int | None = field(default=None, metadata={"metavar": "N"})
    """envs the evaluations step (default: 4, or --eval-episodes where fewer); on --eval-servers, the envs those
    servers host"""
    eval_servers: str | None = field(default=None, metadata={"metavar": "ADDRESSES"})
    """running env servers, of the run's env, to evaluate on (--eval-every), as --servers names them: needed
    by a run on --servers (a server serves one learner at a time, so the training fleet cannot lend its
    envs); without --servers, instead of the extra local server"""
    capture_video: bool = False
    """write RUN_DIR/videos/step-<global step>.gif (CleanRL's --capture-video): one episode of the deterministic
    policy of the nets at each evaluation (--eval-every, seeded as it is) and of the nets the run ends with
    (--total-timesteps reached or --stop-at-return met; not a Ctrl-C'd run; one cut short by a Ctrl-C, or at
    the end a kill, is filmed first by --resume), played on an env made in this
    process with render_mode rgb_array and the training envs' kwargs, wrappers and time limit (frames never
    cross the wire: the env and its renderer must be installed here, for classic control pip install
    'envfleet[video]'; checked at the start). summary.json's videos lists them; --track logs each to W&B
    (TensorBoard gets none: its add_video needs moviepy). Training goes on exactly as without it"""

    # -- tracking (Weights & Biases) ------------------------------------------------------------------------
    track: bool = False
    """log the run to Weights & Biases (needs the extra: pip install 'envfleet[track]'): metrics.jsonl's
    figures by TensorBoard's tag names at each global step, config.json as the W&B config, summary.json as
    its summary; the W&B run is named after the run dir. Recorded: --resume goes on in the same W&B run
    (--no-track: not this time). Its files go to the run dir's wandb/ (unless WANDB_DIR says where). wandb
    reads its own WANDB_* variables (WANDB_MODE=offline, WANDB_API_KEY, WANDB_DIR, ...) (default for a
    new run: $ENVFLEET_TRACK, on or off; else off)"""
    wandb_project_name: str = field(default=DEFAULT_WANDB_PROJECT, metadata={"metavar": "NAME"})
    """the W&B project --track logs to (default: $WANDB_PROJECT, else envfleet)"""
    wandb_entity: str | None = field(default=None, metadata={"metavar": "NAME"})
    """the W&B entity (team or user) of --track's project (default: $WANDB_ENTITY, else your default entity)"""

    # -- PPO (unset: the preset's value) --------------------------------------------------------------------
    preset: Preset = "auto"
    """hyperparameter defaults: classic (RL Zoo's CartPole PPO), mujoco (CleanRL's continuous PPO),
    atari (CleanRL's Atari PPO); auto picks atari for image observations, mujoco for Box actions,
    classic otherwise"""
    num_steps: int | None = None
    """steps per env per rollout"""
    num_minibatches: int | None = None
    """minibatches per epoch (their size follows the number of envs)"""
    update_epochs: int | None = None
    """passes over each rollout"""
    learning_rate: float | None = None
    """Adam's learning rate (eps 1e-5)"""
    anneal_lr: bool | None = None
    """anneal the learning rate linearly to 0 over --total-timesteps"""
    gamma: float | None = None
    """discount factor"""
    gae_lambda: float | None = None
    """GAE's lambda"""
    clip_coef: float | None = None
    """PPO's clipping coefficient"""
    anneal_clip: bool | None = None
    """anneal the clipping coefficient linearly to 0 (RL Zoo's lin_0.2)"""
    clip_vloss: bool | None = None
    """clip the value loss with --clip-coef (annealed with it under --anneal-clip, as in baselines' ppo2)"""
    ent_coef: float | None = None
    """entropy bonus coefficient"""
    vf_coef: float | None = None
    """value loss coefficient (the value loss is half the squared error, as CleanRL's; SB3's is the whole)"""
    max_grad_norm: float | None = None
    """clip the gradient's global norm to this"""
    target_kl: float | None = None
    """stop an update's epochs early once approx KL exceeds this; 0: never"""
    norm_adv: bool | None = None
    """normalise advantages per minibatch"""
    norm_obs: bool | None = None
    """normalise vector observations (a Dict's vector keys alone) by running mean and std (clipped to +-10)"""
    norm_reward: bool | None = None
    """scale rewards by the running std of the discounted return (clipped to +-10)"""
    clip_reward: bool | None = None
    """train on the sign of the reward (Atari); returns are still reported unclipped"""
    hidden_sizes: tuple[int, ...] | None = None
    """MLP hidden layer sizes, comma-separated"""
    action_bounds: Literal["clip", "squash"] | None = None
    """Box actions: clip Gaussian samples to the bounds, or squash them with tanh"""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "servers":  # (checked below: a list of addresses is taken too)
                continue
            value = getattr(self, f.name)
            if (taken := coerced(f.name, value)) is not value:
                object.__setattr__(self, f.name, value := taken)
            if (wrong := type_error(f.name, value)) is not None:
                raise TypeError(wrong)
        servers: object = self.servers
        if isinstance(servers, list | tuple) and servers and all(isinstance(a, str) for a in servers):
            # (from Python: LocalServers(...).addresses, a list, as RemoteVectorEnv takes them)
            object.__setattr__(self, "servers", ",".join(servers))
        elif servers is not None and not isinstance(servers, str):
            raise TypeError(
                f"servers: expected addresses, as 'host:port,host:port' or a list of such strings, got {servers!r}"
            )
        check_addresses(self.servers)
        for name in ("env", "run_dir", "resume"):
            if getattr(self, name) == "":  # (a shell variable left unset: "$RUN"), not "not given"
                raise ValueError(f"--{_flag(name)}: expected a value, got an empty string")
        if self.env is None and self.servers is None:
            object.__setattr__(self, "env", DEFAULT_ENV)  # running servers say what they serve
        positive = ["num_servers", "envs_per_server", "num_envs", "total_timesteps", "num_steps", "num_minibatches"]
        for name in [*positive, "update_epochs", "keep_checkpoints", "pipeline_groups", "max_episode_steps"]:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)}: expected an integer >= 1, got {value}")
        non_negative = [
            "step_delay_ms",
            "hang_timeout",
            "checkpoint_every",
            "checkpoint_seconds",
            "torch_threads",
            "seed",
            "metrics_linger",
        ]
        for name in [*non_negative, "target_kl", "ent_coef", "vf_coef"]:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{_flag(name)}: expected a value >= 0, got {value}")
        if self.seed > MAX_SEED:  # (numpy.random.seed said "Seed must be between ..." without naming --seed)
            raise ValueError(f"--seed: expected an integer from 0 to 2**32 - 1 ({MAX_SEED}), got {self.seed}")
        for name in ("gamma", "gae_lambda"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"--{_flag(name)}: expected a value in [0, 1], got {value}")
        positive_floats = [
            "learning_rate",
            "clip_coef",
            "max_grad_norm",
            "connect_timeout",
            "timeout",
            "keepalive_timeout",
            "reset_timeout",
        ]
        for name in [*positive_floats, "give_up_after"]:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{_flag(name)}: expected a value > 0, got {value}")
        # Infinity means "never stop early" for --stop-at-return (docker-compose.yml documents it); any
        # other infinity would hang a run, or fail it at once ("no answer within the inf s deadline"):
        # refused, as NaN is.
        if self.stop_at_return == math.inf:
            object.__setattr__(self, "stop_at_return", None)  # as --no-stop-at-return
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                also = ", or inf (never)" if f.name == "stop_at_return" else ""
                raise ValueError(f"--{_flag(f.name)}: expected a finite number{also}, got {value}")
        check_device(self.device)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port: expected a port number 0-65535, got {self.metrics_port}")
        if not self.metrics_host:
            raise ValueError("--metrics-host: expected a value, got an empty string")
        for name in ("wandb_project_name", "wandb_entity"):
            if getattr(self, name) == "":
                raise ValueError(f"--{_flag(name)}: expected a name, got an empty string")
        if self.metrics_port is None and self.metrics_linger:
            raise ValueError(
                f"--metrics-linger: keeps --metrics-port serving after the run; give --metrics-port too, got "
                f"--metrics-linger {self.metrics_linger:g} alone"
            )
        if self.metrics_port is None and self.metrics_host != METRICS_HOST:
            raise ValueError(
                f"--metrics-host: sets where --metrics-port serves the metrics; give --metrics-port too (0 for a "
                f"free port), got --metrics-host {self.metrics_host} alone"
            )
        self._check_eval()
        if self.hidden_sizes is not None and (not self.hidden_sizes or min(self.hidden_sizes) < 1):
            raise ValueError(f"--hidden-sizes: expected sizes >= 1 such as 64,64, got {self.hidden_sizes}")
        if self.servers is not None and self.backend == "gym":
            raise ValueError("--servers: trains on running env servers, so it cannot go with --backend gym")
        if self.pipeline_groups > 1 and self.backend == "gym":
            raise ValueError("--pipeline-groups: pipelines env servers, so it cannot go with --backend gym")
        if self.backend == "gym" and (self.transport != DEFAULT_TRANSPORT or not self.step_socket):
            flag = "--transport" if self.transport != DEFAULT_TRANSPORT else "--no-step-socket"
            raise ValueError(f"{flag}: says how to reach env servers, so it cannot go with --backend gym")
        if self.servers is not None and self.transport != DEFAULT_TRANSPORT:
            raise ValueError(
                "--transport: says how to reach the env servers this command starts; with --servers the addresses "
                "say it (host:port for TCP, unix:/path for a Unix socket)"
            )
        check_tls(
            self.servers,
            self.tls,
            self.tls_ca,
            self.tls_server_name,
            "the env servers this command starts speak",
            self.tls_client_cert,
            self.tls_client_key,
        )
        if self.auth_token is not None:
            from env_server.protocol import check_token

            check_token(self.auth_token, "--auth-token")
        check_wrappers(self.wrappers)
        if self.servers is None:
            servers, _ = self.local_layout()  # raises on a layout that does not add up
            if self.backend == "remote" and self.pipeline_groups > servers:
                raise ValueError(
                    f"--pipeline-groups: expected at most one group per env server, so at most {servers} for the "
                    f"{servers} local server{'' if servers == 1 else 's'} this command starts, got "
                    f"{self.pipeline_groups}; start more (--num-servers) or pass fewer groups"
                )
        else:
            for name, unset in LOCAL_SERVER_OPTIONS.items():
                if getattr(self, name) != unset:
                    raise ValueError(
                        f"--{_flag(name)}: configures the env servers this command starts, but with --servers "
                        "the running servers decide (set it where they are started)"
                    )

    def _check_eval(self) -> None:
        """ValueError naming the --eval-* option that cannot be taken (see :meth:`__post_init__`)."""
        if self.eval_every < 0:
            raise ValueError(f"--eval-every: expected env steps >= 0 (0: no evaluation), got {self.eval_every}")
        if self.eval_episodes < 1:
            raise ValueError(f"--eval-episodes: expected an integer >= 1, got {self.eval_episodes}")
        if self.eval_envs is not None and self.eval_envs < 1:
            raise ValueError(f"--eval-envs: expected an integer >= 1, got {self.eval_envs}")
        check_addresses(self.eval_servers, "--eval-servers")
        if self.eval_servers is not None and self.backend == "gym":
            raise ValueError(
                "--eval-servers: evaluates on running env servers, so it cannot go with --backend gym (which "
                "evaluates in process)"
            )
        if not self.eval_every:
            return
        if self.servers is not None and self.eval_servers is None:
            # A server serves one learner at a time (its claim), so the training fleet cannot lend envs; nor are
            # envs made here: the servers' env, kwargs and wrappers are theirs, and need not be installed here.
            raise ValueError(
                f"--eval-every: a run on --servers evaluates on env servers of its own: give --eval-servers "
                f"ADDRESSES (running servers of the same env; the training servers serve this learner's rollouts "
                f"alone), or leave --eval-every out (learner eval evaluates checkpoints afterwards), got "
                f"--eval-every {self.eval_every} without --eval-servers"
            )
        if self.servers is not None and self.eval_servers is not None:
            # (as written: a name and its IP, or a compose: service, are told apart by the server's claim, whose
            # error says to close a RemoteVectorEnv of this process, which a user of the command cannot do)
            shared = set(split_addresses(self.servers)) & set(split_addresses(self.eval_servers))
            if shared:
                raise ValueError(
                    f"--eval-servers: {', '.join(sorted(shared))} {'is one of' if len(shared) == 1 else 'are among'} "
                    f"the training servers (--servers); a server serves one learner connection at a time, and the "
                    f"training servers serve its rollouts: give --eval-servers other running servers of the same env"
                )

    def eval_num_envs(self) -> int:
        """The envs an evaluation steps: --eval-envs, else 4, never more than --eval-episodes."""
        return min(self.eval_envs or 4, self.eval_episodes)

    @classmethod
    def from_json(cls, values: dict[str, Any], *, check: bool = True) -> Args:
        """Args from ``to_json``'s output (as config.json and checkpoints hold it); unknown keys are ignored.

        ``check=False``: as recorded, without this version's checks, which may refuse what an older
        version accepted and recorded (a resumed run validates once its overrides are in; eval only reads
        them). TLS options recorded for local servers, which ignored them, are dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in known}
        if kwargs.get("servers") is None:
            kwargs.update(NO_TLS)
        if check:
            return cls(**kwargs)
        unchecked = object.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
            object.__setattr__(unchecked, f.name, kwargs.get(f.name, default))
        return unchecked

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON-ready values, for config.json and checkpoints (the auth token left out)."""
        values = dataclasses.asdict(self)
        values["auth_token"] = None
        return values

    def local_layout(self) -> tuple[int, int]:
        """(servers, envs per server) for envs this command starts, from --num-servers/--envs-per-server/--num-envs."""
        if self.num_envs is None:
            return self.num_servers, self.envs_per_server or 4
        if self.envs_per_server is not None:
            if self.num_envs != self.num_servers * self.envs_per_server:
                raise ValueError(
                    f"--num-envs: expected --num-servers x --envs-per-server = "
                    f"{self.num_servers * self.envs_per_server}, got {self.num_envs}"
                )
            return self.num_servers, self.envs_per_server
        if self.backend == "gym":
            return 1, self.num_envs  # one in-process vector env: no servers to split over
        servers = min(self.num_servers, self.num_envs)
        if self.num_envs % servers:
            raise ValueError(
                f"--num-envs: {self.num_envs} envs do not split evenly over --num-servers {servers}; "
                "pick a multiple, or set --envs-per-server"
            )
        return servers, self.num_envs // servers

    def server_wrappers(self) -> tuple[str, ...]:
        """The env-server wrappers the envs get (see :func:`wrapper_names`)."""
        return wrapper_names(self.wrappers, self.env or "", self.env_kwargs)


def wrapper_names(wrappers: str, env: str, env_kwargs: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """``--wrappers`` as names: comma-separated; ``none`` (or nothing): none; ``auto``: atari for ALE ids
    (``ALE/Pong-v5``, also as ``ale_py:ALE/Pong-v5``) but those made with ``obs_type="ram"`` (the wrapper
    needs the screen), else none."""
    if wrappers.strip() == "auto":
        ram = (env_kwargs or {}).get("obs_type") == "ram"
        return ("atari",) if is_atari(env) and not ram else ()
    if wrappers.strip() == "none":
        return ()
    return tuple(w.strip() for w in wrappers.split(",") if w.strip())


def wrappers_option(names: Sequence[str]) -> str:
    """The ``--wrappers`` value that gives exactly ``names`` (``none`` for none, not ``auto``'s choice)."""
    return ",".join(names) or "none"


def check_wrappers(wrappers: str) -> None:
    """ValueError naming --wrappers where ``wrappers`` names a wrapper the env server does not have (or one
    twice), as the env servers would refuse it: said before any starts."""
    if wrappers.strip() == "auto":
        return
    from env_server.config import ServerConfig

    try:
        ServerConfig(env=DEFAULT_ENV, wrappers=wrapper_names(wrappers, ""))
    except ValueError as err:
        raise ValueError(f"--{err}") from None  # ("wrappers: expected names among ...")


def check_addresses(servers: str | None, flag: str = "--servers") -> None:
    """ValueError naming ``flag`` where it is given but names no address (a blank, commas only), or one
    written wrong (``localhost:notaport``: :func:`learner.discovery.check_written`, which looks nothing up),
    so that a command refuses it as a usage error (exit status 2) before anything starts."""
    if servers is None:
        return
    if not servers.strip(" ,"):
        raise ValueError(f"{flag}: expected addresses such as host:port,host:port, got {servers!r}")
    try:
        check_written(servers)
    except AddressError as err:
        raise ValueError(f"{flag}: {err}") from None


NO_TLS: dict[str, Any] = {
    "tls": False,
    "tls_ca": None,
    "tls_server_name": None,
    "tls_client_cert": None,
    "tls_client_key": None,
}
"""The TLS options of a run on the env servers it starts (plaintext): what a run moved off --servers gets."""


def check_tls(
    servers: str | None,
    tls: bool,
    tls_ca: str | None,
    tls_server_name: str | None,
    local_servers: str,
    tls_client_cert: str | None = None,
    tls_client_key: str | None = None,
) -> None:
    """ValueError naming the option where the TLS options do not fit ``servers``: an empty value; a
    server name or client certificate without TLS ($ENVFLEET_TLS_CA, which gives --tls-ca for --servers
    where a command reads the environment, counts); a client certificate without its key or the
    reverse; TLS without --servers (``local_servers``, e.g. "the env servers this command starts
    speak", plaintext)."""
    for flag, value in (
        ("--tls-ca", tls_ca),
        ("--tls-server-name", tls_server_name),
        ("--tls-client-cert", tls_client_cert),
        ("--tls-client-key", tls_client_key),
    ):
        if value == "":
            raise ValueError(f"{flag}: expected a value, got an empty string")
    ca_variable = servers is not None and bool(os.environ.get("ENVFLEET_TLS_CA"))
    if tls_server_name is not None and not (tls or tls_ca or ca_variable):
        raise ValueError("--tls-server-name: applies to TLS connections; add --tls or --tls-ca")
    if (tls_client_cert is None) != (tls_client_key is None):
        given, missing = (
            ("--tls-client-cert", "--tls-client-key")
            if tls_client_key is None
            else ("--tls-client-key", "--tls-client-cert")
        )
        raise ValueError(
            f"{given}: goes with {missing} (the client certificate and its private key): give both or neither"
        )
    if servers is None and (tls or tls_ca or tls_client_cert):
        flag = "--tls" if tls else "--tls-ca" if tls_ca else "--tls-client-cert"
        raise ValueError(
            f"{flag}: connects to running --servers with TLS; {local_servers} plaintext on loopback (or a Unix socket)"
        )
    if tls_client_cert is not None and not (tls or tls_ca or ca_variable):
        raise ValueError(
            "--tls-client-cert: a client certificate is presented in a TLS handshake; add --tls or --tls-ca"
        )


def check_served_env_here(env: str | None, servers: str | None, given: str | None, what: str, confirm: str) -> None:
    """ValueError where a run trained on running ``servers`` would have ``env``, a name that imports a
    module (``module:Name``), built here with no env named on this command line (``given``: the one
    named, None for none; an env other than the run's is the caller's to refuse or take).

    Such a run's env is the one its servers said they serve: a server (or whatever answers at its address)
    chose that name, and building it here imports the module and calls what it names, with the kwargs the
    servers said. envfleet imports nothing named over the wire, in either direction, unless the user
    names it too. A gymnasium id without a module (``CartPole-v1``, ``ALE/Pong-v5``) imports nothing
    and needs no confirming. ``what``: what would build it (for the message); ``confirm``: the option that
    names it."""
    if env is None or servers is None or ":" not in env or given is not None:
        return
    module = env.partition(":")[0]
    raise ValueError(
        f"{what}: makes the run's env here, {env}, which imports the module {module}: that name is what the "
        f"servers the run trained on ({servers}) said they serve, and envfleet imports no name that came over "
        f"the wire; give {confirm} {env} to build it here (if you trust it)"
    )


def is_atari(env: str) -> bool:
    """Whether ``env`` names an ALE game (``ALE/Pong-v5``, ``ale_py:ALE/Pong-v5``, ``ale_py:PongNoFrameskip-v4``:
    ale_py's module names the ids it registers)."""
    module, _, name = env.rpartition(":")
    return name.startswith("ALE/") or module.partition(".")[0] == "ale_py"


def check_device(spec: str) -> str:
    """``spec`` if it names a device the learner can use, else ValueError naming --device."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", spec):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {spec!r}")
    return spec


def _flag(name: str) -> str:
    return name.replace("_", "-")


@functools.cache
def _field_types() -> dict[str, Any]:
    return get_type_hints(Args)


def coerced(name: str, value: object) -> object:
    """``value`` for ``Args``' field ``name`` as its type has it where it stands for one exactly: a whole float
    for an integer (``total_timesteps=1e6`` from Python, recorded so in config.json), 0 or 1 for a bool, a
    path for a string, numpy's str for a string; else ``value`` itself."""
    wanted = _field_types().get(name)
    if wanted is None or value is None or isinstance(value, bool):
        return value
    kinds = set(get_args(wanted)) | {wanted}
    literal = any(get_origin(kind) is Literal for kind in kinds)
    if int in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    if bool in kinds and isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if (str in kinds or literal) and isinstance(value, os.PathLike | str) and type(value) is not str:
        return str(os.fspath(value))
    return value


def type_error(name: str, value: object) -> str | None:
    """What is wrong with ``value`` as ``Args``' field ``name`` by its type (a config.json edited by hand,
    Args built from Python), naming the option as --resume's and the CLI's messages do; None if nothing
    (its range is __post_init__'s to check; a value :func:`coerced` takes is nothing wrong). Unknown names:
    None."""
    wanted = _field_types().get(name)
    if wanted is None or _fits(coerced(name, value), wanted):
        return None
    return f"--{_flag(name)}: expected {_described(wanted)}, got {value!r} ({type(value).__name__})"


def _fits(value: object, wanted: Any) -> bool:
    origin, params = get_origin(wanted), get_args(wanted)
    if wanted is Any:
        return True
    if wanted is type(None):
        return value is None
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in params)
    if params and origin not in (tuple, dict):  # a union: X | None
        return any(_fits(value, member) for member in params)
    if origin is tuple:  # tuple[int, ...] (lists too: JSON has no tuples)
        return isinstance(value, tuple | list) and all(_fits(item, params[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(key, str) for key in value)
    if wanted is float:  # (numpy's numbers too)
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if wanted is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return isinstance(value, wanted)


def _described(wanted: Any) -> str:
    origin, params = get_origin(wanted), get_args(wanted)
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in params)
    if params and origin not in (tuple, dict):
        return " or ".join(_described(member) for member in params)
    if origin is tuple:
        return "a list of " + _described(params[0]).removeprefix("an ").removeprefix("a ") + "s"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return "an object" if origin is dict else names.get(wanted, getattr(wanted, "__name__", str(wanted)))


@dataclass(frozen=True)
class PPOConfig:
    """The hyperparameters a run uses: its preset's, overridden by what ``Args`` sets."""

    preset: str
    total_timesteps: int
    num_steps: int
    num_minibatches: int
    update_epochs: int
    learning_rate: float
    anneal_lr: bool
    gamma: float
    gae_lambda: float
    clip_coef: float
    anneal_clip: bool
    clip_vloss: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    target_kl: float
    norm_adv: bool
    norm_obs: bool
    norm_reward: bool
    clip_reward: bool
    hidden_sizes: tuple[int, ...]
    action_bounds: Literal["clip", "squash"]


_COMMON: dict[str, Any] = {
    "anneal_lr": True,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "target_kl": 0.0,
    "norm_adv": True,
    "hidden_sizes": (64, 64),
    "action_bounds": "clip",
}

PRESETS: dict[str, dict[str, Any]] = {
    # RL Baselines3 Zoo's tuned PPO for CartPole-v1 (hyperparams/ppo.yml: 8 envs, n_steps 32,
    # batch 256, 20 epochs, gamma 0.98, gae_lambda 0.8, lr and clip range lin_0.001 / lin_0.2,
    # ent_coef 0, SB3's defaults otherwise: no value clipping). The value loss is CleanRL's 0.5 * MSE * vf_coef,
    # half SB3's MSE * vf_coef at the same vf_coef 0.5: actor and critic are separate nets under Adam, so
    # only the shared gradient-norm clip sees the difference.
    "classic": {
        **_COMMON,
        "total_timesteps": 100_000,
        "num_steps": 32,
        "num_minibatches": 1,
        "update_epochs": 20,
        "learning_rate": 1e-3,
        "gamma": 0.98,
        "gae_lambda": 0.8,
        "clip_coef": 0.2,
        "anneal_clip": True,
        "clip_vloss": False,
        "ent_coef": 0.0,
        "norm_obs": False,
        "norm_reward": False,
        "clip_reward": False,
    },
    # CleanRL's ppo_continuous_action.py (its 2048-step batch spread over 8 envs), with its
    # NormalizeObservation and NormalizeReward wrappers done on the learner's side (one set of statistics for
    # all envs; the reward scaler's return starts again at each episode's end: see RewardScaler).
    "mujoco": {
        **_COMMON,
        "total_timesteps": 1_000_000,
        "num_steps": 256,
        "num_minibatches": 32,
        "update_epochs": 10,
        "learning_rate": 3e-4,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "clip_coef": 0.2,
        "anneal_clip": False,
        "clip_vloss": True,
        "ent_coef": 0.0,
        "norm_obs": True,
        "norm_reward": True,
        "clip_reward": False,
    },
    # CleanRL's ppo_atari.py (ClipRewardEnv done on the learner's side).
    "atari": {
        **_COMMON,
        "total_timesteps": 10_000_000,
        "num_steps": 128,
        "num_minibatches": 4,
        "update_epochs": 4,
        "learning_rate": 2.5e-4,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "clip_coef": 0.1,
        "anneal_clip": False,
        "clip_vloss": True,
        "ent_coef": 0.01,
        "norm_obs": False,
        "norm_reward": False,
        "clip_reward": True,
    },
}


def pick_preset(preset: str, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> str:
    """The preset ``auto`` stands for, given the env's spaces (other names pass through)."""
    if preset != "auto":
        return preset
    from learner.ppo import is_image_space  # (here: torch, which ppo imports, is not needed for --help)

    if is_image_space(observation_space):
        return "atari"
    if isinstance(action_space, gym.spaces.Box):
        return "mujoco"
    return "classic"


def resolve_ppo(args: Args, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> PPOConfig:
    """The run's hyperparameters: the preset's, with every field ``args`` sets taking precedence."""
    name = pick_preset(args.preset, observation_space, action_space)
    values = dict(PRESETS[name])
    for f in dataclasses.fields(PPOConfig):
        given = getattr(args, f.name, None)
        if given is not None and f.name != "preset":
            values[f.name] = given
    return PPOConfig(preset=name, **values)


def default_run_dir(env: str) -> str:
    """``runs/<env>-<YYYYmmdd-HHMMSS>``, the env's name made safe for a path (ALE/Pong-v5: ALE-Pong-v5)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", env).strip("-") or "env"
    return f"runs/{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
