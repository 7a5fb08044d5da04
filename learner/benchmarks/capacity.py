"""Capacity on paper: what one replica costs the learner's CPU, and the network, per step.

    python -m learner.benchmarks.capacity                       # 1, 4, 16, 32 replicas x 4 CartPole envs
    python -m learner.benchmarks.capacity --replicas 1,8,64 --seconds 5 --json capacity.json

Two measurements, the raw material of the README's "Beyond one host":

1. **CPU per replica-step.** N local env servers (CartPole-v1 x K, loopback TCP) stepped by one
   ``RemoteVectorEnv`` as fast as they go, with ready-made random actions (no policy: its cost is
   the same however the envs are served). The learner process's CPU time, and each server's (from
   /proc), are divided by the steps taken. CPU time, unlike wall time, hardly depends on how busy
   the machine is, and a least-squares line ``cpu per fleet step = a + b * N`` gives the cost of one
   more replica (b): a learner core drives replicas stepping r times a second until ``N * r * b``
   reaches one second per second.
2. **Bytes per step.** The StepRequest and StepResponse a replica exchanges per step, for vector
   observations (CartPole-v1 x 4) and Atari-size ones (Pong, 8 envs, 4 x 84 x 84 uint8 frame
   stacks), as protobuf sizes and with the framing of gRPC, HTTP/2 and TCP/IP added (estimated;
   ``tests.measure_netns`` counts the real bytes on a veth link).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from learner.argtypes import int_list, positive_int, positive_seconds

__all__ = ["main", "measure_cpu", "measure_message_sizes", "wire_bytes"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MSS = 1448
"""TCP payload per segment on a 1500-byte MTU link with timestamps (52 bytes of IP and TCP headers)."""
HTTP2_FRAME = 16_384
"""HTTP/2's default largest DATA frame: each carries a 9-byte header."""


def wire_bytes(payload: int) -> int:
    """Bytes on an Ethernet-MTU link for one gRPC message of ``payload`` bytes on an open stream:
    the 5-byte gRPC length prefix, a 9-byte HTTP/2 header per DATA frame, 52 bytes of IP and TCP per
    segment (ACKs and Ethernet framing left out)."""
    message = payload + 5
    framed = message + 9 * -(-message // HTTP2_FRAME)
    return framed + 52 * -(-framed // MSS)


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def measure_cpu(
    replicas: int, envs_per_server: int, seconds: float, env: str = "CartPole-v1", server_args: Sequence[str] = ()
) -> dict[str, Any]:
    """One fleet of ``replicas`` local servers stepped for ``seconds``: steps and CPU per step."""
    from learner.local import LocalServers
    from learner.remote import RemoteVectorEnv

    with (
        LocalServers(env, replicas, envs_per_server, transport="tcp", server_args=server_args) as servers,
        RemoteVectorEnv(servers.addresses, copy=False) as envs,
    ):
        actions = [np.stack([envs.single_action_space.sample() for _ in range(envs.num_envs)]) for _ in range(64)]
        envs.reset(seed=0)
        for t in range(50):  # warm up (connections, allocations)
            envs.step(actions[t % len(actions)])
        server_cpu = [_process_cpu_seconds(pid) for pid in servers.pids]
        learner_cpu = time.process_time()
        start = time.perf_counter()
        steps = 0
        while time.perf_counter() - start < seconds:
            for _ in range(10):
                envs.step(actions[steps % len(actions)])
                steps += 1
        wall = time.perf_counter() - start
        learner_cpu = time.process_time() - learner_cpu
        server_cpu = [_process_cpu_seconds(pid) - before for pid, before in zip(servers.pids, server_cpu, strict=True)]
    return {
        "env": env,
        "replicas": replicas,
        "envs_per_server": envs_per_server,
        "fleet_steps": steps,
        "seconds": round(wall, 3),
        "fleet_steps_per_s": round(steps / wall, 1),
        "env_steps_per_s": round(steps * replicas * envs_per_server / wall, 1),
        "learner_cpu_fraction": round(learner_cpu / wall, 3),
        "learner_cpu_us_per_fleet_step": round(learner_cpu / steps * 1e6, 1),
        "learner_cpu_us_per_replica_step": round(learner_cpu / (steps * replicas) * 1e6, 1),
        "server_cpu_us_per_step": round(float(np.mean(server_cpu)) / steps * 1e6, 1),
    }


def measure_message_sizes() -> list[dict[str, Any]]:
    """Request and response sizes of one step, for vector and Atari-size observations."""
    import grpc

    from env_server import codec
    from env_server.protocol import grpc_target
    from env_server.rpc import env_pb2 as pb
    from env_server.rpc import env_pb2_grpc as pb_grpc
    from learner.local import LocalServers

    cases = [
        ("CartPole-v1, 4 envs (4 float32 each)", "CartPole-v1", 4, []),
        ("ALE/Pong-v5, 8 envs (atari wrappers: 4 x 84 x 84 uint8 each)", "ALE/Pong-v5", 8, ["--wrappers", "atari"]),
    ]
    out = []
    for label, env, num_envs, server_args in cases:
        with (
            LocalServers(env, 1, num_envs, server_args=server_args) as servers,
            grpc.insecure_channel(
                grpc_target(servers.addresses[0]), options=[("grpc.max_receive_message_length", 64 * 2**20)]
            ) as channel,
        ):
            stub = pb_grpc.EnvServiceStub(channel)
            handshake = stub.Handshake(
                pb.HandshakeRequest(client_name="capacity", accepts_compact_bounds=True), timeout=30
            )
            space = codec.decode_space(handshake.spec.action_space, "action_space")
            stub.Reset(pb.ResetRequest(session_id=handshake.session_id), timeout=30)
            request = pb.StepRequest(session_id=handshake.session_id)
            codec.encode_value(np.stack([space.sample() for _ in range(num_envs)]), request.actions, "actions")
            response = stub.Step(request, timeout=30)
            stub.Release(pb.ReleaseRequest(session_id=handshake.session_id), timeout=30)
        up, down = request.ByteSize(), response.ByteSize()
        out.append(
            {
                "case": label,
                "num_envs": num_envs,
                "request_bytes": up,
                "response_bytes": down,
                "request_wire_bytes": wire_bytes(up),
                "response_wire_bytes": wire_bytes(down),
            }
        )
    return out


def fit_per_replica(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares ``learner cpu per fleet step = a + b * replicas``: (a, b) in microseconds."""
    n = np.array([r["replicas"] for r in rows], dtype=float)
    y = np.array([r["learner_cpu_us_per_fleet_step"] for r in rows], dtype=float)
    if len(rows) < 2:
        return 0.0, float(y[0] / n[0])
    b, a = np.polyfit(n, y, 1)
    return float(a), float(b)


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'replicas':>8} {'fleet steps/s':>14} {'env steps/s':>12} {'learner CPU':>12} {'us/fleet step':>14} "
        f"{'us/replica-step':>16} {'server us/step':>15}"
    )
    for row in rows:
        print(
            f"{row['replicas']:>8} {row['fleet_steps_per_s']:>14,.0f} {row['env_steps_per_s']:>12,.0f} "
            f"{row['learner_cpu_fraction']:>12.0%} {row['learner_cpu_us_per_fleet_step']:>14,.0f} "
            f"{row['learner_cpu_us_per_replica_step']:>16,.0f} {row['server_cpu_us_per_step']:>15,.0f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.benchmarks.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replicas",
        type=int_list("integers >= 1", minimum=1),
        default=[1, 4, 16, 32],
        metavar="N,N",
        help="fleet sizes to measure (default: 1,4,16,32)",
    )
    parser.add_argument(
        "--envs-per-server", type=positive_int, default=4, metavar="N", help="CartPole envs per replica (default: 4)"
    )
    parser.add_argument(
        "--seconds", type=positive_seconds, default=3.0, metavar="S", help="seconds each fleet steps (default: 3)"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=2, metavar="N", help="rounds over the fleet sizes; medians (default: 2)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    sizes = args.replicas

    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for r in range(args.rounds):
        for n in sizes if r % 2 == 0 else reversed(sizes):
            samples[n].append(measure_cpu(n, args.envs_per_server, args.seconds))
    rows = []
    for n in sizes:
        runs = samples[n]
        row = dict(runs[0])
        for key in ("fleet_steps_per_s", "env_steps_per_s", "learner_cpu_fraction", "learner_cpu_us_per_fleet_step"):
            row[key] = round(float(np.median([x[key] for x in runs])), 3)
        for key in ("learner_cpu_us_per_replica_step", "server_cpu_us_per_step"):
            row[key] = round(float(np.median([x[key] for x in runs])), 1)
        rows.append(row)
    a, b = fit_per_replica(rows)
    atari = [
        measure_cpu(n, 8, args.seconds, "ALE/Pong-v5", ["--wrappers", "atari"]) for n in (1, max(2, min(sizes[-1], 4)))
    ]
    sizes_rows = measure_message_sizes()

    print(
        f"Learner CPU per step, CartPole-v1 x {args.envs_per_server} per replica, loopback TCP, medians of {args.rounds}"
    )
    _print_rows(rows)
    print(f"fit: learner CPU per fleet step = {a:,.0f} us + {b:,.0f} us x replicas")
    print()
    print("The same for ALE/Pong-v5 x 8 per replica (atari wrappers: 4 x 84 x 84 uint8 frame stacks), one round")
    _print_rows(atari)
    print()
    print(f"{'step messages':<62} {'request B':>10} {'response B':>11} {'on the wire (up/down)':>24}")
    for row in sizes_rows:
        wire = f"{row['request_wire_bytes']:,} / {row['response_wire_bytes']:,}"
        print(f"{row['case']:<62} {row['request_bytes']:>10,} {row['response_bytes']:>11,} {wire:>24}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "cpu": rows,
                    "atari": atari,
                    "fit_us": {"per_fleet_step": a, "per_replica": b},
                    "messages": sizes_rows,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
