"""What requests can make an env server hold in memory, at its limit on requests.

    python -m tests.measure_request_memory [--max-request-bytes N] [--at-once 16]

Starts a CartPole server (2 envs) on a Unix socket, with its step socket, passing --max-request-bytes
when given (a server without the option: its old limit, 64 MiB), and claims it. Then, one case at a
time, sends requests shaped for the most memory per byte that protobuf's parsing takes (a list of
empty Values, or of empty Seeds: 2 bytes each on the wire, ~50 parsed), each as large as the server
accepts: a Step, a Reset, a Step one byte over the limit, 16 Steps at once (left out where they could
take half the memory this machine has available); and it opens 8 step-socket connections that each
send all but the last byte of a frame as long as the server accepts. Reported per case: the server's resident
memory (VmRSS) before, its peak (VmHWM, reset before each case) and the growth. First, for scale,
the sizes of realistic large requests (1024 envs with Box(64,) float64 actions; a reset of 1024 envs
with seeds, a mask and options).

Worst-case bytes are built by hand (a client building 33 million Values would itself need GBs).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from env_server import codec
from env_server.protocol import FRAME_HEADER, FRAME_STEP, MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.step_socket import MAX_CONNECTIONS

MIB = 1024 * 1024
EMPTY = b"\x0a\x00"  # ValueList.values (field 1) or ResetRequest.seeds (field 2, b"\x12\x00"): an empty message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def worst_step(session_id: str, limit: int) -> bytes:
    """A StepRequest of at most ``limit`` bytes whose actions are a list of as many empty Values as fit."""
    head = _field(1, session_id.encode())
    count = (limit - len(head) - 20) // len(EMPTY)
    return head + _field(2, _field(4, EMPTY * count))  # actions: Value.list (4) of ValueList


def worst_reset(session_id: str, limit: int) -> bytes:
    """A ResetRequest of at most ``limit`` bytes of as many empty Seeds as fit."""
    head = _field(1, session_id.encode())
    return head + b"\x12\x00" * ((limit - len(head)) // 2)


def realistic_sizes() -> list[tuple[str, int]]:
    step = pb.StepRequest(session_id="0" * 32)
    codec.encode_value(np.zeros((1024, 64)), step.actions, "actions")
    reset = pb.ResetRequest(session_id="0" * 32, reset_mask=[True] * 1024)
    for seed in range(1 << 40, (1 << 40) + 1024):
        reset.seeds.add(value=seed)
    codec.encode_value({"difficulty": 3, "goal": np.zeros(64), "layout": "maze-17"}, reset.options, "options")
    return [
        ("Step: 1024 envs x Box(64,) float64 actions", step.ByteSize()),
        ("Reset: 1024 seeds, reset_mask, options {difficulty, goal (64 float64), layout}", reset.ByteSize()),
    ]


def memory(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak so far) of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def measure(pid: int, name: str, size: int, case: Callable[[], str]) -> None:
    time.sleep(0.5)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux)
    before = memory(pid, "VmRSS")
    outcome = case()
    time.sleep(0.5)
    peak = memory(pid, "VmHWM")
    print(
        f"  {name:<44} {size / MIB:7.2f} MiB   RSS {before / MIB:5.0f} -> peak {peak / MIB:6.0f} MiB "
        f"(+{(peak - before) / MIB:5.0f})   {outcome}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-request-bytes", help="passed to the server (default: the server's own default)")
    parser.add_argument("--at-once", type=int, default=16, help="worst-case Steps sent at once (default: 16)")
    args = parser.parse_args()
    print("realistic large requests:")
    for name, size in realistic_sizes():
        print(f"  {name}: {size} bytes ({size / MIB:.2f} MiB)")
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:
        path = str(Path(folder) / "env.sock")
        command = [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--num-envs", "2", "--unix-socket", path]
        if args.max_request_bytes:
            command += ["--max-request-bytes", args.max_request_bytes]
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert server.stdout is not None
            line = server.stdout.readline().strip()
            if not line.startswith("listening on "):
                raise RuntimeError(f"env-server did not start: {line!r}")
            measure_server(server.pid, line.removeprefix("listening on "), args.at_once)
        finally:
            server.kill()
            server.wait(timeout=30)
    return 0


def measure_server(pid: int, address: str, at_once: int) -> None:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        hello = stub.Handshake(pb.HandshakeRequest(client_name="measure"), timeout=30)
        stub.Reset(pb.ResetRequest(session_id=hello.session_id), timeout=30)
        limit = getattr(hello, "max_request_bytes", 0) or MAX_MESSAGE_BYTES  # (older servers: 64 MiB)
        print(f"server pid {pid}, limit on requests {limit} bytes ({limit / MIB:g} MiB):")
        step = channel.unary_unary("/envfleet.v1.EnvService/Step")
        reset = channel.unary_unary("/envfleet.v1.EnvService/Reset")

        def code(send: Callable[..., bytes], request: bytes) -> str:
            try:
                send(request, timeout=120)
            except grpc.RpcError as err:
                return err.code().name
            return "OK"

        def many(request: bytes) -> str:
            codes = set()
            for future in [step.future(request, timeout=300) for _ in range(at_once)]:
                try:
                    future.result()
                    codes.add("OK")
                except grpc.RpcError as err:
                    codes.add(err.code().name)
            return ",".join(sorted(codes))

        worst = worst_step(hello.session_id, limit)
        seeds = worst_reset(hello.session_id, limit)
        over = worst + bytes(limit + 1 - len(worst))
        measure(pid, "Step, a list of empty Values", len(worst), lambda: code(step, worst))
        measure(pid, "Reset, empty Seeds", len(seeds), lambda: code(reset, seeds))
        measure(pid, "Step, one byte over the limit", len(over), lambda: code(step, over))
        # (at 64 MiB, 16 at once took this 24 GB machine's memory: the kernel killed the server at 23 GB)
        if at_once * 30 * limit < memory_available() / 2:
            measure(pid, f"{at_once} such Steps at once", at_once * len(worst), lambda: many(worst))
        else:
            print(
                f"  ({at_once} such Steps at once: left out, they could take ~{at_once * 25 * limit / 2**30:.0f} GiB)"
            )
        connections: list[socket.socket] = []

        def unfinished_frames() -> str:
            for _ in range(MAX_CONNECTIONS):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(hello.step_socket)
                sock.sendall(FRAME_HEADER.pack(limit, FRAME_STEP) + bytes(limit - 1))
                connections.append(sock)
            return f"{MAX_CONNECTIONS} connections open"

        measure(
            pid, f"{MAX_CONNECTIONS} step-socket frames, all but 1 byte", MAX_CONNECTIONS * limit, unfinished_frames
        )
        for sock in connections:
            sock.close()
        actions = codec.encode_value(np.zeros(2, dtype=np.int64), pb.Value())
        stub.Step(pb.StepRequest(session_id=hello.session_id, actions=actions), timeout=30)
        print(f"  the session steps on; RSS now {memory(pid, 'VmRSS') / MIB:.0f} MiB")


def memory_available() -> int:
    """``MemAvailable`` of this machine, bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    sys.exit(main())
