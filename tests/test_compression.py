"""env-server --compression: answers compressed by gRPC (every method, streamed or not), identical once
decompressed, much smaller for Atari frame stacks; a client that does not accept the algorithm gets
them uncompressed; the option and its ENVFLEET_COMPRESSION variable.

Bytes are counted by a TCP forwarding proxy between a real learner (or raw gRPC stubs) and a real
server: ``python -m tests.test_compression`` prints the figures the README quotes (bytes per step and
steps per second, with and without compression)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import ServerConfig
from env_server.__main__ import parse_args
from env_server.codec import encode_value
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import RemoteVectorEnv
from tests.compare import assert_same
from tests.conftest import ServerProcess, SpawnServer, started_logs

try:
    import ale_py  # noqa: F401

    HAS_ALE = True
except ImportError:
    HAS_ALE = False

needs_ale = pytest.mark.skipif(not HAS_ALE, reason="needs ale_py (the dev extras)")

PONG = ("ALE/Pong-v5", "--wrappers", "atari")

# A gRPC message (HTTP/2 DATA) whose compressed flag is set, then its length, then a gzip stream's
# magic, or a zlib (deflate) stream's header as zlib's default level writes it.
GZIP_MESSAGE = re.compile(rb"\x01....\x1f\x8b\x08", re.DOTALL)
DEFLATE_MESSAGE = re.compile(rb"\x01....\x78\x9c", re.DOTALL)


class CountingProxy:
    """A TCP forwarding proxy on 127.0.0.1 that counts the bytes it carries each way (``up``: client
    to server, ``down``: server to client), and keeps the first ``keep`` bytes of what comes down."""

    def __init__(self, target: str, keep: int = 0) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.keep = keep
        self.up = self.down = 0
        self.kept = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, down: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:  # (counted before it is passed on: a client that has read it sees it counted)
                    if down:
                        self.down += len(data)
                        if len(self.kept) < self.keep:
                            self.kept += data[: self.keep - len(self.kept)]
                    else:
                        self.up += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.up, self.down

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


MakeProxy = Callable[..., CountingProxy]


@pytest.fixture
def proxy() -> Iterator[MakeProxy]:
    """``proxy(address, keep=0)`` -> a CountingProxy in front of ``address``, closed after the test."""
    made: list[CountingProxy] = []

    def make(target: str, keep: int = 0) -> CountingProxy:
        made.append(CountingProxy(target, keep))
        return made[-1]

    yield make
    for each in made:
        each.close()


def run_episode(address: str, num_steps: int, seed: int = 7) -> list[Any]:
    """What a learner gets from the server at ``address``: its reset and ``num_steps`` steps of seeded
    random actions (the server's answers, decoded)."""
    env = RemoteVectorEnv(address, timeout=60, reset_timeout=60)
    try:
        env.action_space.seed(seed)
        got: list[Any] = [env.reset(seed=seed)]
        got += [env.step(env.action_space.sample()) for _ in range(num_steps)]
        return got
    finally:
        env.close()


# -- what the answers are ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "args", "num_steps"),
    [
        ("CartPole-v1", (), 60),
        pytest.param(PONG[0], PONG[1:], 30, marks=needs_ale),
    ],
)
@pytest.mark.slow
def test_compressed_answers_are_the_uncompressed_ones(
    spawn_server: SpawnServer, env: str, args: tuple[str, ...], num_steps: int
) -> None:
    """Same seeds, same actions: the learner gets the same observations, rewards, terminations,
    truncations and infos from a server that compresses (gzip, deflate) as from one that does not."""
    plain = spawn_server(env, 4, *args)
    gzip = spawn_server(env, 4, *args, "--compression", "gzip")
    deflate = spawn_server(env, 4, *args, environ={"ENVFLEET_COMPRESSION": "deflate"})
    expected = run_episode(plain.address, num_steps)
    for server in (gzip, deflate):
        assert_same(run_episode(server.address, num_steps), expected)


METHODS = ("GetSpec", "Handshake", "Reset", "Step", "StepStream")
KEEP = 1 << 24  # (what the proxies keep of what comes down: all of it, in these tests)


def _raw_calls(
    proxy: CountingProxy, options: list[tuple[str, Any]] | None = None
) -> tuple[list[Any], dict[str, bytes]]:
    """Every EnvService method a learner calls, answered, through ``proxy``: GetSpec, Handshake, Reset,
    unary Step, two StepStream steps, Release (raw stubs; ``options``: the client channel's); and
    what came down the connection during each (from the end of the one before: a unary call's
    answer, or both of StepStream's, with their HTTP/2 framing and headers)."""
    down: dict[str, bytes] = {}
    with grpc.insecure_channel(proxy.address, options=options or []) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=30)
        start = len(proxy.kept)

        def called(method: str) -> None:
            nonlocal start
            down[method] = bytes(proxy.kept[start:])
            start = len(proxy.kept)

        spec = stub.GetSpec(pb.GetSpecRequest(), timeout=30)
        called("GetSpec")
        hello = stub.Handshake(pb.HandshakeRequest(client_name="compression-test"), timeout=30)
        called("Handshake")
        session = hello.session_id
        seeds = [pb.Seed(value=i) for i in range(spec.spec.num_envs)]
        reset = stub.Reset(pb.ResetRequest(session_id=session, seeds=seeds), timeout=60)
        called("Reset")
        actions = encode_value(np.arange(spec.spec.num_envs, dtype=np.int64) % 2, pb.Value())
        request = pb.StepRequest(session_id=session, actions=actions)
        step = stub.Step(request, timeout=30)
        called("Step")
        streamed = list(stub.StepStream(iter([request, request]), timeout=30))
        called("StepStream")
        stub.Release(pb.ReleaseRequest(session_id=session), timeout=30)
    # (what differs from server to server, and from run to run, whatever the compression)
    for answer in (step, *streamed):
        answer.env_seconds = 0.0
    hello.session_id = spec.spec.server_id = hello.spec.server_id = ""
    return [spec, hello, reset, step, *streamed], down


def _same_messages(got: list[Any], expected: list[Any]) -> None:
    """The answers ``_raw_calls`` got are the same messages as ``expected``."""
    assert [type(m).__name__ for m in got] == [type(m).__name__ for m in expected]
    for a, b in zip(got, expected, strict=True):
        assert a == b, type(a).__name__


def _spawn_each(spawn_server: SpawnServer, env: str, *args: str) -> dict[str, ServerProcess]:
    """A server of 4 x ``env`` for each compression, by name."""
    return {name: spawn_server(env, 4, *args, "--compression", name) for name in ("none", "gzip", "deflate")}


@pytest.mark.slow
def test_answers_come_compressed_as_the_client_accepts_and_decompress_to_the_same_messages(
    spawn_server: SpawnServer, proxy: MakeProxy
) -> None:
    """gRPC's clients (the learner's) accept gzip and deflate by default: unary answers (Handshake,
    Step) and streamed ones (StepStream) come compressed with the server's algorithm, and are the
    same messages as an uncompressed server's once decompressed. A client that accepts only the
    other algorithm gets that one; one that accepts no compression gets the answers as they are, and
    works (with gRPC's default algorithm instead, its calls failed: "Compression algorithm not
    supported"). Answers that compression would not make smaller (CartPole's Reset) go as they are."""
    servers = _spawn_each(spawn_server, "CartPole-v1")
    expected, plain = _raw_calls(proxy(servers["none"].address, keep=KEEP))
    for down in plain.values():
        assert not GZIP_MESSAGE.search(down) and not DEFLATE_MESSAGE.search(down)
    accepts = {  # (bits: identity 1, deflate 2, gzip 4)
        "gzip and deflate": None,
        "gzip only": [("grpc.compression_enabled_algorithms_bitset", 0b101)],
        "deflate only": [("grpc.compression_enabled_algorithms_bitset", 0b011)],
        "no compression": [("grpc.compression_enabled_algorithms_bitset", 0b001)],
    }
    for server in ("gzip", "deflate"):
        for client, options in accepts.items():
            got, downs = _raw_calls(proxy(servers[server].address, keep=KEEP), options)
            _same_messages(got, expected)
            used = {"gzip and deflate": server, "gzip only": "gzip", "deflate only": "deflate"}.get(client)
            for method, down in downs.items():
                # (GetSpec's and Reset's answers, small, gain little or nothing: compressed or not)
                must = used is not None and method in ("Handshake", "Step", "StepStream")
                for algorithm, pattern in (("gzip", GZIP_MESSAGE), ("deflate", DEFLATE_MESSAGE)):
                    found = pattern.search(down) is not None
                    if algorithm != used:
                        assert not found, (server, client, method, algorithm)
                    elif must:
                        assert found, (server, client, method, algorithm)


@needs_ale
@pytest.mark.slow
def test_every_method_s_atari_answers_are_several_times_smaller(spawn_server: SpawnServer, proxy: MakeProxy) -> None:
    """Pong's 4x84x84 frame stacks: each method's answer (the spec's, whose observation space bounds
    are frames too; Reset's, Step's, StepStream's) takes a fraction of the bytes compressed."""
    servers = _spawn_each(spawn_server, *PONG)
    answers, sizes = {}, {}
    for name, server in servers.items():
        answers[name], downs = _raw_calls(proxy(server.address, keep=KEEP))
        sizes[name] = {method: len(down) for method, down in downs.items()}
    _same_messages(answers["gzip"], answers["none"])
    _same_messages(answers["deflate"], answers["none"])
    for name in ("gzip", "deflate"):
        for method in METHODS:
            assert sizes[name][method] * 3 <= sizes["none"][method], (name, method, sizes)


def test_the_step_socket_s_answers_are_the_same_under_a_compressing_server() -> None:
    """Learners on the same host step on the step socket, which compresses nothing whatever
    --compression says; their episodes are those of a server that does not compress."""
    from learner import LocalServers

    answers = []
    for flags in ((), ("--compression", "gzip")):
        servers = LocalServers("CartPole-v1", 1, 4, server_args=flags)
        try:
            answers.append(run_episode(servers.addresses[0], 40))
        finally:
            servers.close()
    assert_same(answers[1], answers[0])


def test_health_checks_of_a_compressing_server_answer_every_client(spawn_server: SpawnServer) -> None:
    """The health service's answers (a status: nothing to gain) go uncompressed, to probes that accept
    no compression too (as Kubernetes' own gRPC probes may not)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import env_server.health

    server = spawn_server("CartPole-v1", 1, "--compression", "gzip")
    assert env_server.health.main(["--address", server.address]) == 0
    for options in ([], [("grpc.compression_enabled_algorithms_bitset", 1)]):
        with grpc.insecure_channel(server.address, options=options) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


# -- the option -----------------------------------------------------------------------------------


@pytest.fixture
def no_envfleet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ENVFLEET_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("no_envfleet_variables")
def test_the_option_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args(["--env", "CartPole-v1"])[0].compression == "none"
    assert parse_args(["--env", "CartPole-v1", "--compression", "gzip"])[0].compression == "gzip"
    monkeypatch.setenv("ENVFLEET_COMPRESSION", "deflate")
    assert parse_args(["--env", "CartPole-v1"])[0].compression == "deflate"
    assert parse_args(["--env", "CartPole-v1", "--compression", "none"])[0].compression == "none"  # (the flag wins)
    with pytest.raises(ValueError) as info:
        ServerConfig(env="CartPole-v1", compression="zstd")
    assert str(info.value) == "compression: expected one of 'none', 'gzip', 'deflate', got 'zstd'"


def _refusal(*args: str, environ: dict[str, str] | None = None) -> str:
    """The last line of what env-server, started with ``args``, says as it refuses to start (status 2, nothing on
    stdout: it never listened). (No timing: a bound of 15 s failed on a loaded machine, 17 s.)"""
    result = subprocess.run(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(environ or {})},
    )
    assert result.returncode == 2 and result.stdout == "", result
    return result.stderr.strip().splitlines()[-1]


def test_an_unknown_compression_is_refused_at_start_naming_the_option_and_the_choices() -> None:
    choices = "(choose from 'none', 'gzip', 'deflate')"
    # (argparse's own: 3.12.8-3.12.x and some 3.13 patch releases print the choices unquoted, gh-86357)
    assert _refusal("--compression", "zstd") in {
        f"env-server: error: argument --compression: invalid choice: 'zstd' {choices}",
        f"env-server: error: argument --compression: invalid choice: 'zstd' {choices.replace(chr(39), '')}",
    }
    assert _refusal(environ={"ENVFLEET_COMPRESSION": "zstd"}) == (
        f"env-server: error: ENVFLEET_COMPRESSION (for --compression): invalid choice 'zstd' {choices}"
    )


def test_the_choice_is_logged_at_start_and_said_in_help(spawn_server: SpawnServer) -> None:
    logs = spawn_server("CartPole-v1", 1, environ={"ENVFLEET_COMPRESSION": "gzip"}).logs()
    assert re.search(r"serving 1 x CartPole-v1 \(sync\) on 127\.0\.0\.1:\d+ \(plaintext, no auth token\), "
                     r"gRPC answers compressed with gzip\n", logs), logs  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:  # (short: Unix socket paths are)
        logs = started_logs("--unix-socket", f"{folder}/env.sock", "--compression", "deflate")
    assert "gRPC answers compressed with deflate (the step socket's are not)" in logs
    assert "compressed" not in started_logs()
    result = subprocess.run(
        [sys.executable, "-m", "env_server", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "COLUMNS": "100"},
    )
    text = " ".join(result.stdout.split())
    assert "--compression {none,gzip,deflate}" in text
    assert "The step socket (--unix-socket), local only, stays uncompressed (default: none)" in text


# -- what it saves, and costs --------------------------------------------------------------------


def server_cpu_s(pid: int) -> float:
    """CPU time (user and system) process ``pid`` has used so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_steps(server: ServerProcess, num_steps: int, proxy: CountingProxy | None = None) -> dict[str, float]:
    """A learner's ``num_steps`` steps of random actions on ``server`` (through ``proxy`` if given,
    which counts the bytes), after a reset and 20 steps of warm-up: bytes per step each way (with a
    proxy), steps per second, and CPU milliseconds per step of the server's process and of this one
    (the learner's decoding, decompression included)."""
    env = RemoteVectorEnv(proxy.address if proxy is not None else server.address, timeout=60, reset_timeout=60)
    try:
        env.action_space.seed(0)
        actions = [env.action_space.sample() for _ in range(64)]
        env.reset(seed=0)
        for i in range(20):
            env.step(actions[i % len(actions)])
        assert server.proc is not None
        up, down = proxy.counts() if proxy is not None else (0, 0)
        cpu, own, started = server_cpu_s(server.proc.pid), time.process_time(), time.perf_counter()
        for i in range(num_steps):
            env.step(actions[i % len(actions)])
        elapsed = time.perf_counter() - started
        figures = {
            "steps_per_s": num_steps / elapsed,
            "server_cpu_ms": (server_cpu_s(server.proc.pid) - cpu) * 1000 / num_steps,
            "learner_cpu_ms": (time.process_time() - own) * 1000 / num_steps,
        }
        if proxy is not None:
            now_up, now_down = proxy.counts()
            figures |= {"up_bytes": (now_up - up) / num_steps, "down_bytes": (now_down - down) / num_steps}
        return figures
    finally:
        env.close()


@needs_ale
@pytest.mark.slow
def test_a_learner_s_atari_steps_take_several_times_fewer_bytes_compressed(
    spawn_server: SpawnServer, proxy: MakeProxy
) -> None:
    """What a learner (RemoteVectorEnv, stepping on StepStream) receives per step of 4 x Pong with
    --wrappers atari: ~113 KB uncompressed, a few KB with gzip (a conservative bound here: 3x)."""
    down = {}
    for name in ("none", "gzip"):
        server = spawn_server(PONG[0], 4, *PONG[1:], "--compression", name)
        down[name] = measure_steps(server, 40, proxy(server.address))["down_bytes"]
    assert down["none"] > 4 * 4 * 84 * 84  # (the frames, as they are)
    assert down["gzip"] * 3 <= down["none"], down


def main() -> None:
    """Print bytes per step (through a counting proxy) and steps per second (direct, loopback TCP) of
    4 x CartPole-v1 and 4 x ALE/Pong-v5 --wrappers atari, uncompressed and compressed: the figures the
    README quotes. Steps per second: ``--steps`` each (default 2000), none and gzip alternating twice."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.test_compression", description=main.__doc__)
    parser.add_argument("--steps", type=int, default=2000, metavar="N", help="steps per timed run (default: 2000)")
    parser.add_argument("--byte-steps", type=int, default=500, metavar="N", help="steps counted (default: 500)")
    args = parser.parse_args()
    workloads = [("CartPole-v1", ())] + ([(PONG[0], PONG[1:])] if HAS_ALE else [])
    for env, extra in workloads:
        print(f"4 x {env} {' '.join(extra)}".rstrip())
        for name in ("none", "gzip", "deflate"):
            server = ServerProcess(env, 4, *extra, "--compression", name)
            counted = CountingProxy(server.address)
            try:
                got = measure_steps(server, args.byte_steps, counted)
            finally:
                counted.close()
                server.stop()
            print(
                f"  {name:8s} bytes/step: server->learner {got['down_bytes']:9,.0f}  "
                f"learner->server {got['up_bytes']:5,.0f}   (through the proxy: {got['steps_per_s']:,.0f} steps/s)"
            )
        for round_ in (1, 2):
            for name in ("none", "gzip"):
                server = ServerProcess(env, 4, *extra, "--compression", name)
                try:
                    got = measure_steps(server, args.steps)
                finally:
                    server.stop()
                print(
                    f"  {name:8s} round {round_}: {got['steps_per_s']:7,.0f} steps/s  server CPU "
                    f"{got['server_cpu_ms']:.3f} ms/step  learner CPU {got['learner_cpu_ms']:.3f} ms/step"
                )


if __name__ == "__main__":
    main()
