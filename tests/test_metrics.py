"""env-server --metrics-port: Prometheus metrics of steps, latency and errors."""

from __future__ import annotations

import math
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from env_server.metrics import LATENCY_BUCKETS, ServerMetrics, serve_registry
from env_server.protocol import package_version
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import AuthenticationError, InvalidRequestError, RemoteVectorEnv
from tests.conftest import SpawnServer, promtool_check


@pytest.fixture
def server() -> Iterator[tuple[str, str]]:
    """A server with metrics on a free port: (gRPC address, metrics URL)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "env_server",
            "--env",
            "CartPole-v1",
            "--num-envs",
            "3",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--log-level",
            "info",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready = proc.stdout.readline().strip()
        assert ready.startswith("listening on "), ready
        # The metrics line is logged before the server says it is ready.
        url = None
        for _ in range(50):
            match = re.search(r"Prometheus metrics on (http://\S+/metrics)", proc.stderr.readline())
            if match:
                url = match.group(1)
                break
        assert url is not None, "no 'Prometheus metrics on' line in the log"
        yield ready.removeprefix("listening on "), url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            key = sample.name + (f"{{{labels}}}" if labels else "")
            if "le" in sample.labels:
                key += f"[le={sample.labels['le']}]"
            samples[key] = sample.value
    return samples


def test_metrics_count_steps_latency_and_errors(server: tuple[str, str]) -> None:
    address, url = server
    before = scrape(url)
    assert before["envfleet_steps_total"] == 0 and before["envfleet_num_envs"] == 3
    assert before["envfleet_session_active"] == 0
    with RemoteVectorEnv([address]) as envs:
        server_id = envs.replica_stats()[0].server_id  # (its spec's)
        assert len(server_id) == 16
        envs.reset(seed=0)
        for _ in range(25):
            envs.step(np.ones(3, dtype=np.int64))
        with pytest.raises(InvalidRequestError):
            envs.step(np.array([0, 1, 9]))  # refused by the client: the server never sees it
        with grpc.insecure_channel(address) as channel:  # a bad request the server itself refuses
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.EnvServiceStub(channel).Step(pb.StepRequest(session_id="not-a-session"), timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        during = scrape(url)
        assert during["envfleet_session_active"] == 1
    after = scrape(url)
    assert after["envfleet_steps_total"] == 25
    assert after["envfleet_env_steps_total"] == 75
    assert after["envfleet_resets_total"] == 1
    assert after["envfleet_step_latency_seconds_count"] == 25
    assert 0 < after["envfleet_step_latency_seconds_sum"] < 25
    assert after["envfleet_env_step_latency_seconds_count"] == 25
    assert after["envfleet_step_latency_seconds_bucket[le=+Inf]"] == 25
    assert after["envfleet_errors_total{code=FAILED_PRECONDITION,method=Step}"] == 1
    assert after["envfleet_reset_latency_seconds_count"] == 1
    server_info = [key for key in after if key.startswith("envfleet_server_info{")]
    assert server_info == [
        f"envfleet_server_info{{env_id=CartPole-v1,server_id={server_id},transport=tcp,vectorization=sync,"
        f"version={package_version()}}}"
    ]  # (server_id: what learners know it by, envfleet_learner_replica_info's)
    # The claim ends when the learner closes.
    deadline = time.monotonic() + 5
    while scrape(url)["envfleet_session_active"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_metrics_port_in_use_fails_at_start() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr.strip().splitlines()[-1]


def test_env_errors_and_refused_tokens_are_counted(spawn_server: SpawnServer) -> None:
    server = spawn_server(
        "tests.envs:FaultyEnv",
        2,
        "--env-kwargs",
        '{"raise_at": 2}',
        "--metrics-port",
        "0",
        "--log-level",
        "info",
        environ={"ENVFLEET_AUTH_TOKEN": "t0ken"},
    )
    match = re.search(r"Prometheus metrics on (http://\S+/metrics)", server.logs())
    assert match, server.logs()
    url = match.group(1)
    with pytest.raises(AuthenticationError):
        RemoteVectorEnv([server.address], auth_token="wrong")
    with RemoteVectorEnv([server.address], auth_token="t0ken", fault_tolerant=True) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.zeros(2, dtype=np.int64))
        assert envs.fault_stats().env_errors == 1
    after = scrape(url)
    assert after["envfleet_env_errors_total"] == 1  # the failed step (not again the reset step after it)
    refused = {key: n for key, n in after.items() if key.startswith("envfleet_errors_total{code=UNAUTHENTICATED,")}
    assert sum(refused.values()) >= 1 and all("method=" in key for key in refused), refused


def test_the_endpoint_has_process_metrics_zeroed_error_series_and_no_created_series(
    server: tuple[str, str],
) -> None:
    _, url = server
    before = scrape(url)
    # The process's own CPU and memory, as the default registry of prometheus_client has them.
    assert before["process_cpu_seconds_total"] > 0 and before["process_resident_memory_bytes"] > 0
    assert any(key.startswith("python_info{") for key in before)
    # Each method's common errors are there at 0 before any: increase() sees the first one.
    for method in ("Handshake", "Reset", "Step", "StepStream"):
        for code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL"):
            key = f"envfleet_errors_total{{code={code},method={method}}}"
            assert before.get(key) == 0, f"{key}: expected 0 before any error, got {before.get(key)}"
    created = [key for key in before if key.endswith("_created") or "_created{" in key]
    assert created == [], f"expected no _created series, got {created}"
    # Latency buckets from 10 us to past the learner's default 10 s timeout, for steps and resets.
    for histogram in ("envfleet_step_latency_seconds", "envfleet_reset_latency_seconds"):
        bounds = sorted(float(key.split("[le=")[1][:-1]) for key in before if key.startswith(f"{histogram}_bucket"))
        assert bounds[:2] == [1e-05, 1.5e-05] and bounds[-3:] == [30.0, 60.0, float("inf")], (histogram, bounds)


def test_a_unix_socket_server_names_its_transport_in_its_info(spawn_server: SpawnServer) -> None:
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:  # (short: Unix socket paths are)
        server = spawn_server(
            "CartPole-v1", 1, "--unix-socket", f"{folder}/env.sock", "--metrics-port", "0", "--log-level", "info"
        )
        match = re.search(r"Prometheus metrics on (http://\S+/metrics)", server.logs())
        assert match, server.logs()
        info = [key for key in scrape(match.group(1)) if key.startswith("envfleet_server_info{")]
        server.stop()
    assert len(info) == 1 and ",transport=unix+step-socket," in info[0], info


def test_the_created_series_stay_on_in_other_registries() -> None:
    """(prometheus_client's disable_created_metrics() turns them off for the whole process)"""
    ServerMetrics(env_id="CartPole-v1", num_envs=1, vectorization="sync")
    other = CollectorRegistry()
    Counter("other_requests", "A counter of another registry of the process", registry=other).inc()
    names = {s.name for m in other.collect() for s in m.samples}
    assert "other_requests_created" in names, names


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile() of cumulative ``buckets`` (upper bound, count), +Inf last."""
    rank = q * buckets[-1][1]
    below, lower = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            return lower if math.isinf(upper) else lower + (upper - lower) * (rank - below) / (count - below)
        below, lower = count, upper
    raise AssertionError(buckets)


def test_a_step_of_a_fixed_time_has_a_median_near_it() -> None:
    """A step of a fixed D ms (--step-delay-ms, a robot's rate) takes a little more, just above a bucket's
    edge: histogram_quantile(0.5) puts it halfway up the bucket, within a third of the time in buckets
    1-1.5-2-3-5-7 apart (was 1-2-5: 3.5 ms for 2.1 ms, 15 ms for 10.4 ms), from 10 us to 10 s."""
    assert len(LATENCY_BUCKETS) < 40 and (LATENCY_BUCKETS[0], LATENCY_BUCKETS[-1]) == (1e-05, 60.0)
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))
    for seconds in [0.0021, 0.0104, *np.geomspace(1.0001e-05, 9.99, 100)]:
        metrics = ServerMetrics(env_id="CartPole-v1", num_envs=1, vectorization="sync")
        for _ in range(10):
            metrics.observe_step(float(seconds), float(seconds), 1)
        samples = [s for m in metrics.registry.collect() for s in m.samples]
        for name in ("envfleet_step_latency_seconds", "envfleet_env_step_latency_seconds"):
            buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name == f"{name}_bucket"]
            median = _histogram_quantile(0.5, buckets)
            assert 0.75 <= median / seconds <= 1.35, (name, seconds, median)


def test_promtool_finds_nothing_to_fix_in_the_server_s_metrics() -> None:
    """Prometheus' own linter (naming, units, _total suffixes, help texts), where it is installed: the server's
    series after steps, a reset, errors and a session."""
    server = ServerMetrics(env_id="CartPole-v1", num_envs=2, vectorization="sync", needs_token=True)
    server.set_transport("unix+step-socket")
    server.set_server_id("0123456789abcdef")
    server.observe_step(0.001, 0.0005, 2)
    server.observe_reset(0.002)
    server.count_error("Step", "INVALID_ARGUMENT")
    server.session_started()
    server.session_ended("released")
    promtool_check(server.registry)


def test_a_burst_of_connections_to_the_endpoint_is_taken_in_at_once() -> None:
    """The endpoint's listen backlog was socketserver's 5: 80 connects one after another took 11 s (the 7th of
    each burst waited for its SYN to be sent again, 1 s later), so a scrape in a flood of connections waited
    seconds where the accept loop keeps up (from the hostile-client hunt); now 0.01 s."""
    server = serve_registry(CollectorRegistry(), "127.0.0.1", 0)
    connections = []
    try:
        start = time.monotonic()
        for _ in range(64):
            connections.append(socket.create_connection(("127.0.0.1", server.server_port), timeout=30))
        took = time.monotonic() - start
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30) as answer:
            assert answer.status == 200
    finally:
        for connection in connections:
            connection.close()
        server.shutdown()
        server.server_close()
    assert took < 3.0, f"64 connects took {took:.1f} s: SYNs dropped, the backlog full?"
