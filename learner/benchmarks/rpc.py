"""The cost of one round trip: a Python pipe, gRPC unary calls, StepStream, and RemoteVectorEnv.step."""

from __future__ import annotations

import functools
import multiprocessing
import queue
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import gymnasium as gym
import numpy as np

from env_server import codec
from env_server.protocol import grpc_target
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc

__all__ = ["measure_rpc"]


def _echo(conn: Connection) -> None:
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(data)


def _time_per_call(fn: Callable[[], Any], seconds: float) -> float:
    """Microseconds per call of ``fn``, over about ``seconds``."""
    for _ in range(50):
        fn()
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(20):
            fn()
        calls += 20
        now = time.perf_counter()
        if now >= deadline:
            return (now - start) / calls * 1e6


_KIND_NAMES = {"tcp": "tcp", "unix": "unix, step socket", "unix-grpc": "unix, gRPC StepStream"}


def measure_rpc(*, rounds: int, seconds: float, transports: tuple[str, ...] = ("tcp", "unix")) -> dict[str, Any]:
    """Median microseconds per round trip of each way to step one CartPole env (and the floors)."""
    import grpc

    from learner.local import LocalServers
    from learner.remote import RemoteVectorEnv

    samples: dict[str, list[float]] = {}
    kinds: list[str] = []  # the ways RemoteVectorEnv steps measured: tcp, unix (step socket), unix-grpc

    def add(name: str, fn: Callable[[], Any]) -> None:
        samples.setdefault(name, []).append(_time_per_call(fn, seconds))

    ctx = multiprocessing.get_context("forkserver")
    parent, child = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(child,), daemon=True)
    echo.start()
    ping = b"x" * 64

    def pipe_round_trip() -> None:
        parent.send_bytes(ping)
        parent.recv_bytes()

    local = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])
    local.reset(seed=0)
    action = np.zeros(1, dtype=np.int64)
    opened: list[Any] = []
    try:
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("Python pipe round trip (AsyncVectorEnv's transport), 64 B", pipe_round_trip),
            ("SyncVectorEnv(1).step, CartPole-v1 (in-process)", lambda: local.step(action)),
        ]
        for transport in transports:
            raw = LocalServers("CartPole-v1", 1, 1, transport=transport)
            opened.append(raw)
            channel = grpc.insecure_channel(grpc_target(raw.addresses[0]))
            opened.append(channel)
            stub = pb_grpc.EnvServiceStub(channel)
            session = stub.Handshake(
                pb.HandshakeRequest(client_name="learner bench rpc", accepts_compact_bounds=True), timeout=10
            ).session_id
            stub.Reset(pb.ResetRequest(session_id=session), timeout=10)
            request = pb.StepRequest(session_id=session)
            codec.encode_value(action, request.actions, "actions")
            release = pb.ReleaseRequest(session_id="")

            # One request in flight at a time, like a learner: the next goes once the answer came.
            outbox: queue.SimpleQueue[pb.StepRequest | None] = queue.SimpleQueue()
            stream = stub.StepStream(iter(outbox.get, None))
            opened.append(stream)

            def stream_step(outbox: queue.SimpleQueue[Any] = outbox, stream: Any = stream, r: Any = request) -> None:
                outbox.put(r)
                next(stream)

            cases += [
                (f"gRPC unary call, empty answer ({transport})", functools.partial(stub.Release, release)),
                (f"gRPC unary Step, 1 env ({transport})", functools.partial(stub.Step, request)),
                (f"gRPC StepStream step, 1 env, sync stub ({transport})", stream_step),
            ]
            # Over Unix sockets RemoteVectorEnv steps on the servers' step sockets, unless told not to.
            for kind, step_socket in ((transport, True), *([("unix-grpc", False)] if transport == "unix" else [])):
                fleet = LocalServers("CartPole-v1", 1, 1, transport=transport)
                opened.append(fleet)
                remote = RemoteVectorEnv(fleet.addresses, copy=False, step_socket=step_socket)
                opened.append(remote)
                remote.reset(seed=0)
                kinds.append(kind)
                cases.append(
                    (f"RemoteVectorEnv(1x1).step ({_KIND_NAMES[kind]})", functools.partial(remote.step, action))
                )
        for r in range(rounds):
            order = cases[r % len(cases) :] + cases[: r % len(cases)]
            for name, fn in order:
                add(name, fn)
    finally:
        for thing in reversed(opened):
            if hasattr(thing, "cancel"):
                thing.cancel()
            else:
                thing.close()
        local.close()
        parent.send_bytes(b"")
        echo.join(timeout=5)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    local_step = medians["SyncVectorEnv(1).step, CartPole-v1 (in-process)"]
    overhead = {kind: medians[f"RemoteVectorEnv(1x1).step ({_KIND_NAMES[kind]})"] - local_step for kind in kinds}
    return {
        "unit": "microseconds per round trip (median over rounds)",
        "results": [
            {
                "name": name,
                "median_us": round(medians[name], 1),
                "min_us": round(min(v), 1),
                "max_us": round(max(v), 1),
                "samples_us": [round(x, 1) for x in v],
            }
            for name, v in samples.items()
        ],
        "remote_overhead_per_step_us": {t: round(v, 1) for t, v in overhead.items()},
        "note": "remote_overhead_per_step_us: RemoteVectorEnv(1x1).step minus SyncVectorEnv(1).step, i.e. what "
        "serving one env adds to each step, the server's env step included in both (unix: steps on the step "
        "socket; unix-grpc: on gRPC's StepStream). A server with K envs pays it once per batched step, not once "
        "per env.",
    }
