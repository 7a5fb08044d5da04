"""Env-steps per second of vector envs, measured side by side: interleaved rounds, medians, paired ratios."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import gymnasium as gym
import numpy as np

from env_server.config import ServerConfig
from learner.benchmarks.envs import env_fns
from learner.interrupts import start_forkserver_deaf_to_ctrl_c

if TYPE_CHECKING:
    from learner.remote import RemoteVectorEnv

__all__ = ["Measured", "Variant", "Workload", "measure_workload", "prepare_subprocesses", "server_args"]

log = logging.getLogger(__name__)

# Modules the forkserver imports once, so that the baselines' subprocesses share them (memory) and
# start quickly. The forkserver is a fresh process: gRPC is never initialised in it, which makes
# starting subprocess vector envs safe after this process opened gRPC channels (fork is not).
_PRELOAD = [
    "numpy",
    "gymnasium",
    "learner.benchmarks.envs",
    "gymnasium.vector.async_vector_env",
    "learner.benchmarks.preload",  # (SB3, ale-py, MuJoCo: see there)
]


def prepare_subprocesses() -> None:
    """Make subprocess vector envs start through a forkserver (call before the first one starts), and
    start it, deaf to Ctrl-C (its preload: torch, through SB3's, takes seconds); the bench stops them when it
    stops (their vector envs' close). Returns once it is ready."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    start_forkserver_deaf_to_ctrl_c()


@dataclass(frozen=True)
class Variant:
    """One vector env to measure."""

    name: str
    """Label in tables and charts."""
    kind: str
    """``remote``, ``sync`` (gymnasium SyncVectorEnv), ``async`` (gymnasium AsyncVectorEnv),
    ``sb3`` (stable-baselines3 SubprocVecEnv) or ``vector_entry_point`` (the env's own in-process
    vectorized implementation)."""
    num_envs: int
    servers: int = 0
    """Remote: how many env servers."""
    transport: str = "tcp"
    """Remote: ``tcp`` (loopback) or ``unix`` (Unix domain sockets, and the servers' step sockets)."""
    vectorization: str = "sync"
    """Remote: how each server steps its envs (``env-server --vectorization``)."""
    groups: int = 1
    """Remote: groups stepped with send/recv (pipelining); 1 steps all servers together."""
    step_socket: bool = True
    """Remote over ``unix``: steps on the servers' step sockets (False: gRPC's StepStream)."""
    spin_wait_ms: float | None = None
    """Remote: the servers' ``--spin-wait-ms`` (None: LocalServers' choice)."""

    @property
    def layout(self) -> str:
        return f"{self.servers}x{self.num_envs // self.servers}" if self.kind == "remote" else str(self.num_envs)


@dataclass(frozen=True)
class Workload:
    """An env and the vector envs that step it, all with the same total number of envs."""

    name: str
    """Short id used in the JSON (e.g. ``cartpole-8``)."""
    title: str
    """Human-readable title."""
    config: ServerConfig
    """The env as the servers build it (env id, kwargs, wrappers, step delay); baselines build the same."""
    num_envs: int
    variants: tuple[Variant, ...]
    note: str = ""
    """How to read the numbers (e.g. the step delay's semantics)."""


@dataclass
class Measured:
    """One variant's throughput samples (env-steps/s), one per round."""

    variant: Variant
    samples: list[float] = field(default_factory=list)
    error: str = ""
    """Why the variant could not run (e.g. a missing optional dependency); empty when it ran."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def as_dict(self) -> dict[str, Any]:
        samples = self.samples
        median = self.median
        return {
            **dataclasses.asdict(self.variant),
            "layout": self.variant.layout,
            "samples": [round(s, 1) for s in samples],
            "median": round(median, 1) if samples else None,
            "min": round(min(samples), 1) if samples else None,
            "max": round(max(samples), 1) if samples else None,
            # (max - min) / median over the rounds: how noisy this variant was in this run.
            "spread": round((max(samples) - min(samples)) / median, 3) if samples and median > 0 else None,
            "error": self.error or None,
        }


class Stepper(Protocol):
    """A vector env under test, ready to step random actions for a while."""

    def run(self, seconds: float) -> tuple[int, float]:
        """Step for about ``seconds``; returns (env steps taken, seconds elapsed)."""
        ...

    def close(self) -> None: ...


class GymStepper:
    """Any gymnasium VectorEnv (local or remote), stepped with a fixed cycle of random actions."""

    def __init__(self, envs: gym.vector.VectorEnv, seed: int, closers: Sequence[Callable[[], None]] = ()) -> None:
        self.envs = envs
        self._closers = closers
        envs.reset(seed=seed)
        envs.action_space.seed(seed)
        self.actions = [envs.action_space.sample() for _ in range(32)]
        self._t = 0

    def run(self, seconds: float) -> tuple[int, float]:
        envs, actions, n = self.envs, self.actions, len(self.actions)
        steps = 0
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            envs.step(actions[self._t % n])
            self._t += 1
            steps += 1
            now = time.perf_counter()
            if now >= deadline:
                return steps * envs.num_envs, now - start

    def close(self) -> None:
        self.envs.close()
        for close in self._closers:
            close()


class PipelinedStepper(GymStepper):
    """A RemoteVectorEnv stepped group by group with send/recv: each group is sent new actions as
    soon as its results are in, so groups step while the learner handles the others."""

    def __init__(self, envs: RemoteVectorEnv, seed: int, closers: Sequence[Callable[[], None]] = ()) -> None:
        super().__init__(envs, seed, closers)
        self.remote = envs
        self._slices = envs.group_slices
        for g, sl in enumerate(self._slices):
            envs.send(self.actions[0][sl], g)

    def run(self, seconds: float) -> tuple[int, float]:
        envs, actions, slices, n = self.remote, self.actions, self._slices, len(self.actions)
        env_steps = 0
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            g, *_ = envs.recv()
            sl = slices[g]
            env_steps += sl.stop - sl.start
            self._t += 1
            envs.send(actions[self._t % n][sl], g)
            now = time.perf_counter()
            if now >= deadline:
                return env_steps, now - start


class SB3Stepper(GymStepper):
    """stable-baselines3's SubprocVecEnv (one pipe and process per env; it resets episodes itself)."""

    def __init__(self, venv: Any, seed: int) -> None:
        self.envs = venv
        self._closers = ()
        venv.seed(seed)
        venv.reset()
        space = venv.action_space
        space.seed(seed)
        self.actions = [np.stack([space.sample() for _ in range(venv.num_envs)]) for _ in range(32)]
        self._t = 0


def server_args(config: ServerConfig, vectorization: str = "sync") -> list[str]:
    """``env-server`` options that build ``config``'s env (the env id and K are LocalServers')."""
    args = ["--vectorization", vectorization]
    if config.wrappers:
        args += ["--wrappers", ",".join(config.wrappers)]
    if config.step_delay_ms:
        args += ["--step-delay-ms", f"{config.step_delay_ms:g}"]
    return args


def _build(workload: Workload, variant: Variant, seed: int) -> Stepper:
    config, n = workload.config, variant.num_envs
    if variant.kind == "sync":
        return GymStepper(gym.vector.SyncVectorEnv(env_fns(config, n)), seed)
    if variant.kind == "async":
        return GymStepper(gym.vector.AsyncVectorEnv(env_fns(config, n), context="forkserver"), seed)
    if variant.kind == "sb3":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        return SB3Stepper(SubprocVecEnv(env_fns(config, n), start_method="forkserver"), seed)
    if variant.kind == "vector_entry_point":
        return GymStepper(
            gym.make_vec(config.env, num_envs=n, vectorization_mode="vector_entry_point", **config.env_kwargs), seed
        )
    if variant.kind == "remote":
        from learner.local import LocalServers
        from learner.remote import RemoteVectorEnv

        servers = LocalServers(
            config.env,
            variant.servers,
            n // variant.servers,
            env_kwargs=config.env_kwargs or None,
            server_args=server_args(config, variant.vectorization),
            transport=variant.transport,
            spin_wait_ms=variant.spin_wait_ms,
        )
        try:
            envs = RemoteVectorEnv(
                servers.addresses, num_groups=variant.groups, copy=False, step_socket=variant.step_socket
            )
        except BaseException:
            servers.close()
            raise
        cls = PipelinedStepper if variant.groups > 1 else GymStepper
        return cls(envs, seed, closers=[servers.close])
    raise ValueError(f"variant {variant.name!r}: unknown kind {variant.kind!r}")


def measure_workload(
    workload: Workload,
    *,
    rounds: int,
    seconds: float,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
    on_round: Callable[[list[Measured]], None] = lambda _: None,
) -> list[Measured]:
    """Throughput of every variant of ``workload``: all built first, then stepped in turns.

    Each round steps every variant for ``seconds`` (the order rotates between rounds), so that slow
    drifts in the machine's load hit all variants alike and each round gives paired ratios.
    ``on_round`` gets the results after each round (so far: a bench stopped mid-workload keeps them).
    """
    results = [Measured(v) for v in workload.variants]
    steppers: list[Stepper | None] = []
    try:
        for m in results:
            progress(f"{workload.title}: starting {m.variant.name}")
            try:
                steppers.append(_build(workload, m.variant, seed))
            except Exception as err:  # a missing optional dependency, an env that cannot be built
                log.warning("%s: %s cannot run: %s", workload.title, m.variant.name, err)
                m.error = f"{type(err).__name__}: {err}"
                steppers.append(None)
        live = [i for i, s in enumerate(steppers) if s is not None]
        for i in live:  # warm-up: first steps allocate buffers, open streams, fill caches
            stepper = steppers[i]
            assert stepper is not None
            stepper.run(min(0.2, seconds))
        for r in range(rounds):
            order = live[r % len(live) :] + live[: r % len(live)] if live else []
            for i in order:
                stepper = steppers[i]
                assert stepper is not None
                env_steps, elapsed = stepper.run(seconds)
                results[i].samples.append(env_steps / elapsed)
            on_round(results)  # (before the line saying the round is done)
            progress(
                f"{workload.title}: round {r + 1}/{rounds}: "
                + ", ".join(f"{results[i].variant.name} {results[i].samples[-1]:,.0f}" for i in live)
            )
    finally:
        # After a Ctrl-C, the terminal's SIGINT has reached the local vector envs' workers too: closing
        # them then fails (broken pipes), as expected.
        aborted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        for stepper in steppers:
            if stepper is not None:
                try:
                    stepper.close()
                except Exception as err:
                    log.log(logging.DEBUG if aborted else logging.WARNING, "closing a benchmark env failed: %s", err)
    return results
