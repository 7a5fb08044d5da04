"""The workloads ``learner bench`` measures: envs, total envs, and the vector envs compared on each."""

from __future__ import annotations

from env_server.config import ServerConfig
from learner.benchmarks.throughput import Variant, Workload

__all__ = ["LATENCY_DELAY_MS", "LATENCY_SIZES", "latency_workload", "throughput_workloads"]

LATENCY_DELAY_MS = 2.0
"""Step delay of the latency-bound env (a robot or a remote simulator)."""
LATENCY_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _baselines(n: int, *, sync: bool = True, entry_point: bool = False) -> list[Variant]:
    out = [Variant(f"SyncVectorEnv({n})", "sync", n)] if sync else []
    out += [Variant(f"AsyncVectorEnv({n})", "async", n), Variant(f"SB3 SubprocVecEnv({n})", "sb3", n)]
    if entry_point:
        out.append(Variant(f"make_vec vector_entry_point({n})", "vector_entry_point", n))
    return out


def _remote(
    servers: int,
    n: int,
    transport: str = "unix",
    *,
    groups: int = 1,
    vectorization: str = "sync",
    step_socket: bool = True,
    spin_wait_ms: float | None = None,
) -> Variant:
    k = n // servers
    name = f"remote {servers}x{k} {transport}"
    if transport == "unix" and not step_socket:
        name += " grpc"
    if vectorization != "sync":
        name += " vec"
    if groups > 1:
        name += f" pipelined/{groups}"
    if spin_wait_ms == 0 and transport == "unix" and step_socket:
        name += " no spin"
    return Variant(name, "remote", n, servers, transport, vectorization, groups, step_socket, spin_wait_ms)


def throughput_workloads() -> dict[str, Workload]:
    """The throughput workloads, by name."""
    cartpole = ServerConfig(env="CartPole-v1")
    workloads = [
        Workload(
            "cartpole-8",
            "CartPole-v1, 8 envs",
            cartpole,
            8,
            (
                *_baselines(8, entry_point=True),
                _remote(2, 8, "tcp"),
                _remote(2, 8, "unix", step_socket=False),
                _remote(2, 8, "unix"),
                _remote(2, 8, "unix", spin_wait_ms=0),
                _remote(2, 8, "unix", groups=2),
                _remote(2, 8, "unix", groups=2, vectorization="vector_entry_point"),
                _remote(1, 8, "unix"),
            ),
        ),
        Workload(
            "cartpole-64",
            "CartPole-v1, 64 envs",
            cartpole,
            64,
            (
                *_baselines(64, entry_point=True),
                _remote(2, 64, "unix"),
                _remote(2, 64, "unix", groups=2),
                _remote(2, 64, "unix", groups=2, vectorization="vector_entry_point"),
                _remote(4, 64, "unix", groups=2),
            ),
        ),
        Workload(
            "halfcheetah-8",
            "HalfCheetah-v5, 8 envs",
            ServerConfig(env="HalfCheetah-v5"),
            8,
            (*_baselines(8), _remote(2, 8, "unix"), _remote(2, 8, "unix", groups=2)),
        ),
        Workload(
            "pong-8",
            "ALE/Pong-v5 (atari wrapper: 4x84x84 uint8), 8 envs",
            ServerConfig(env="ALE/Pong-v5", wrappers=("atari",)),
            8,
            (*_baselines(8), _remote(2, 8, "unix"), _remote(2, 8, "unix", groups=2), _remote(4, 8, "unix", groups=2)),
            note="Observations are 4x84x84 uint8 frame stacks (28 KB per env); the baselines apply the same "
            "wrapper (env_server.envs.make_env).",
        ),
    ]
    return {w.name: w for w in workloads}


def latency_workload(num_envs: int, delay_ms: float = LATENCY_DELAY_MS) -> Workload:
    """CartPole whose every step takes at least ``delay_ms``, with ``num_envs`` envs."""
    config = ServerConfig(env="CartPole-v1", step_delay_ms=delay_ms)
    variants = [Variant(f"AsyncVectorEnv({num_envs})", "async", num_envs)]
    if num_envs == 1:
        variants.append(_remote(1, 1))
    else:
        variants += [_remote(2, num_envs), _remote(2, num_envs, groups=2)]
    if num_envs >= 16:
        variants.append(_remote(4, num_envs, groups=4))
    return Workload(
        f"latency-{num_envs}",
        f"CartPole-v1 with a {delay_ms:g} ms step, {num_envs} envs",
        config,
        num_envs,
        tuple(variants),
        note=f"Every env step takes at least {delay_ms:g} ms, the env's own work included (a robot or a remote "
        "simulator). Envs wait concurrently: each AsyncVectorEnv env sleeps in its own process; a server's "
        "K envs wait once per batched step (env-server --step-delay-ms). Ideal: num_envs / delay env-steps/s.",
    )
