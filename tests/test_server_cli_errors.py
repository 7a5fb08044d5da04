"""env-server's start-up errors: which one comes first, what they say, and the --step-socket flags.

Every test runs the real ``python -m env_server`` on real sockets."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from env_server.config import ServerConfig
from env_server.envs import WRAPPERS, EnvBuildError
from env_server.protocol import PROTOCOL_VERSION, STEP_SOCKET_SUFFIX, bind_hint, source_commit
from learner import RemoteVectorEnv
from tests.conftest import SpawnServer, StartServers, needs_proc, started_logs
from tests.envs import DictEnv

SHORT_USAGE = "usage: env-server [options]; see env-server --help"


def run_server(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "env_server", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(environ or {})},
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize(
    ("env", "extra", "fragment"),
    [
        (
            "CartPol-v1",
            [],
            "cannot make env 'CartPol-v1': Environment `CartPol` doesn't exist. Did you mean: `CartPole`?",
        ),
        ("CartPole-v9", [], "Environment version `v9` for environment `CartPole` doesn't exist"),
        ("no_such_module:Env", [], "cannot import module 'no_such_module' of entry point 'no_such_module:Env'"),
        ("no_such_package.envs:Env", [], "cannot import module 'no_such_package.envs'"),
        ("CartPole-v1", ["--wrappers", "nope"], "unknown wrapper 'nope'"),
        ("CartPole-v1", ["--vectorization", "vector_entry_point", "--wrappers", "atari"], "vector_entry_point needs"),
    ],
)
def test_a_bad_env_is_reported_before_a_port_in_use(busy_port: int, env: str, extra: list[str], fragment: str) -> None:
    result = run_server("--env", env, *extra, "--port", str(busy_port))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == ""
    assert lines[-1].startswith("env-server: error: ") and fragment in lines[-1], lines
    assert not any("already in use" in line for line in lines), lines


BROKEN_ENV = """
import gymnasium as gym


def helper(goal):
    if goal > 5:
        raise ValueError(f"goal {goal} is too far: at most 5")


class Broken(gym.Env):
    observation_space = action_space = gym.spaces.Discrete(2)

    def __init__(self, goal=10):
        helper(goal)


class Singular(Broken):
    def __init__(self):
        import numpy as np

        np.linalg.inv(np.zeros((2, 2)))  # (numpy raises: its frames are no env's)
"""


def test_an_env_whose_constructor_raises_says_where_in_the_envs_code(tmp_path: Path) -> None:
    """The env's author saw one line, not where in their code it raised. Said in that line, not as a traceback:
    8 local servers of such an env would print 8 of them."""
    (tmp_path / "brokenenvs.py").write_text(BROKEN_ENV)
    environ = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = run_server("--env", "brokenenvs:Broken", "--port", "0", environ=environ)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "env-server: error: cannot make env 'brokenenvs:Broken': ValueError: goal 10 is too far: at most 5 "
        f"(at {tmp_path / 'brokenenvs.py'}:7 in helper)"
    )
    # A TypeError within its constructor too; gymnasium's own refusals (in its code): their line alone.
    result = run_server("--env", "brokenenvs:Broken", "--env-kwargs", '{"goal": "x"}', "--port", "0", environ=environ)
    assert result.stderr.strip().endswith(f"(at {tmp_path / 'brokenenvs.py'}:6 in helper)")
    assert run_server("--env", "CartPol-v1", "--port", "0").stderr.strip().endswith("Did you mean: `CartPole`?")
    result = run_server("--env", "brokenenvs:Singular", "--port", "0", environ=environ)
    assert result.stderr.strip().endswith(
        f"LinAlgError: Singular matrix (at {tmp_path / 'brokenenvs.py'}:21 in __init__)"
    ), result.stderr


def test_a_bad_value_from_a_variable_is_named_as_that_variable(tmp_path: Path) -> None:
    """A compose file or Swarm sets only variables: the errors named flags nobody gave."""
    (tmp_path / "token").write_text("abcdefgh\n")
    cases = [
        ({"ENVFLEET_HOST": ""}, [], "ENVFLEET_HOST '': expected a host name or address"),
        ({}, ["--host", ""], "--host '': expected a host name or address"),
        ({"ENVFLEET_HOST": "x"}, ["--ho", ""], "--host '': expected a host name or address"),  # (abbreviated)
        ({"ENVFLEET_AUTH_TOKEN_FILE": "/nope"}, [], "ENVFLEET_AUTH_TOKEN_FILE /nope: cannot read it: No such file"),
        (
            {"ENVFLEET_AUTH_TOKEN": "abcdefgh", "ENVFLEET_AUTH_TOKEN_FILE": str(tmp_path / "token")},
            [],
            "ENVFLEET_AUTH_TOKEN and ENVFLEET_AUTH_TOKEN_FILE: give one of them, not both",
        ),
        (
            {"ENVFLEET_AUTH_TOKEN": "abcdefgh"},
            ["--auth-token-file", str(tmp_path / "token")],
            "ENVFLEET_AUTH_TOKEN and --auth-token-file: give one of them, not both",
        ),
        ({"ENVFLEET_AUTH_TOKEN": "a b"}, [], "ENVFLEET_AUTH_TOKEN: expected printable ASCII without spaces"),
    ]
    for environ, args, said in cases:
        result = run_server("--env", "CartPole-v1", "--port", "0", *args, environ=environ)
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
            f"env-server: error: {said}"
        )


def test_a_bad_env_is_reported_before_a_host_this_machine_lacks() -> None:
    result = run_server("--env", "CartPol-v1", "--host", "192.0.2.1", "--port", "0")  # TEST-NET-1
    assert result.returncode == 2 and "Did you mean: `CartPole`?" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("port", ["0", "50051"])
def test_a_host_this_machine_lacks_says_so_on_any_port_without_grpc_s_log(port: str) -> None:
    result = run_server("--env", "CartPole-v1", "--host", "192.0.2.1", "--port", port)  # TEST-NET-1
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines == [
        f"env-server: error: cannot listen on 192.0.2.1:{port}: Cannot assign requested address "
        "(192.0.2.1 is not an address of this machine; give --host one of its own, or 0.0.0.0 for all)"
    ]


def test_bind_hints_follow_the_errno() -> None:
    config = ServerConfig(env="CartPole-v1", host="10.9.9.9", port=80)
    assert "another process has it" in bind_hint(config.host, errno.EADDRINUSE)
    assert "10.9.9.9 is not an address of this machine" in bind_hint(config.host, errno.EADDRNOTAVAIL)
    assert "ports below 1024" in bind_hint(config.host, errno.EACCES)
    assert bind_hint(config.host, errno.ENOBUFS) == "see --host and --port"


@needs_proc
def test_grpc_s_own_log_line_stays_where_it_is_the_only_cause() -> None:
    # The checks before binding pass (the folder exists), gRPC cannot make a socket in /proc: its
    # log line says why, so it is shown, before the error.
    result = run_server("--env", "CartPole-v1", "--unix-socket", "/proc/envfleet-test.sock")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2
    assert lines[-1] == (
        "env-server: error: cannot listen on unix:/proc/envfleet-test.sock: "
        "Failed to bind to address unix:/proc/envfleet-test.sock (gRPC's log line above says why)"
    )
    assert any("/proc/envfleet-test.sock" in line and "No such file or directory" in line for line in lines[:-1]), lines


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("ENVFLEET_NUM_ENVS", "abc", "ENVFLEET_NUM_ENVS (for --num-envs): expected a positive integer, got 'abc'"),
        ("ENVFLEET_PORT", "http", "ENVFLEET_PORT (for --port): expected a port number 0-65535, got 'http'"),
        (
            "ENVFLEET_ENV_KWARGS",
            "[1]",
            "ENVFLEET_ENV_KWARGS (for --env-kwargs): expected a JSON object like '{\"key\": 1}', got list: '[1]'",
        ),
        ("ENVFLEET_GRACE", "-1", "ENVFLEET_GRACE (for --grace): expected a finite number >= 0, got '-1'"),
        (
            "ENVFLEET_STEP_DELAY_MS",
            "inf",
            "ENVFLEET_STEP_DELAY_MS (for --step-delay-ms): expected a finite number >= 0, got 'inf'",
        ),
        (
            "ENVFLEET_STEP_SOCKET",
            "maybe",
            "ENVFLEET_STEP_SOCKET (for --step-socket): expected on or off (or true/false, 1/0, yes/no), got 'maybe'",
        ),
        (
            "ENVFLEET_MAX_REQUEST_BYTES",
            "4MiB",
            "ENVFLEET_MAX_REQUEST_BYTES (for --max-request-bytes): expected a number of bytes in [4096, 67108864], "
            "got '4MiB'",
        ),
    ],
)
def test_a_bad_variable_is_named_not_its_flag(variable: str, value: str, fragment: str) -> None:
    result = run_server("--env", "CartPole-v1", environ={variable: value})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [SHORT_USAGE, f"env-server: error: {fragment}"]


def test_a_flag_overrides_a_bad_variable_and_its_own_errors_name_the_flag() -> None:
    bad = {"ENVFLEET_NUM_ENVS": "abc"}
    result = run_server("--env", "NoSuchEnv-v0", "--num-envs", "2", "--port", "0", environ=bad)
    assert result.returncode == 2 and "NoSuchEnv-v0" in result.stderr.strip().splitlines()[-1]
    result = run_server("--env", "CartPole-v1", "--num-envs", "x", environ=bad)
    last = result.stderr.strip().splitlines()[-1]
    assert last == "env-server: error: argument --num-envs: expected a positive integer, got 'x'"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--env", "CartPole-v1", "--bogus"], "unrecognized arguments: --bogus"),
        (["--env", "CartPole-v1", "--port", "70000"], "argument --port: expected a port number 0-65535, got 70000"),
        (["--env", "CartPole-v1", "--no-step-socket", "off"], "unrecognized arguments: off"),
        (["--env", "CartPole-v1", "--step-socket", "off"], "unrecognized arguments: off"),
        # (inf parsed as a number: every step then failed INTERNAL, time.sleep raising OverflowError)
        (
            ["--env", "CartPole-v1", "--step-delay-ms", "inf"],
            "argument --step-delay-ms: expected a finite number >= 0, got 'inf'",
        ),
        (
            ["--env", "CartPole-v1", "--grace", "Infinity"],
            "argument --grace: expected a finite number >= 0, got 'Infinity'",
        ),
        (
            ["--env", "CartPole-v1", "--claim-timeout", "inf"],
            "argument --claim-timeout: expected a finite number of seconds > 0, got 'inf'",
        ),
        (["--env", "CartPole-v1", "--grace", "nan"], "argument --grace: expected a finite number >= 0, got 'nan'"),
        (
            ["--env", "CartPole-v1", "--max-request-bytes", "1024"],
            "argument --max-request-bytes: expected a number of bytes in [4096, 67108864], got 1024",
        ),
        (
            ["--env", "CartPole-v1", "--max-episode-steps", "0"],
            "argument --max-episode-steps: expected a positive integer, got 0",
        ),
        (  # (a ServerConfig check, named as the flag)
            ["--env", "CartPole-v1", "--vectorization", "vector_entry_point", "--max-episode-steps", "5"],
            "--max-episode-steps (or ENVFLEET_MAX_EPISODE_STEPS): a time limit wraps each env, and "
            "vector_entry_point vectorization has none to wrap; give the limit in env_kwargs if the env's vector "
            "entry point takes one",
        ),
        (
            ["--env", "CartPole-v1", "--wrappers", "flatten,nope"],
            "--wrappers (or ENVFLEET_WRAPPERS): expected names among atari, clip-action, flatten, got unknown "
            "wrapper 'nope'",
        ),
        ([], "--env is required (or set ENVFLEET_ENV)"),
    ],
)
def test_argument_errors_are_a_short_usage_line_and_the_error(args: list[str], error: str) -> None:
    result = run_server(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [SHORT_USAGE, f"env-server: error: {error}"]


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:  # (short: Unix socket paths are)
        yield Path(folder) / "env.sock"


@pytest.mark.parametrize(
    ("flags", "environ", "served"),
    [
        ([], {}, True),
        (["--step-socket"], {"ENVFLEET_STEP_SOCKET": "off"}, True),
        (["--no-step-socket"], {}, False),
        ([], {"ENVFLEET_STEP_SOCKET": "off"}, False),
        ([], {"ENVFLEET_STEP_SOCKET": "on"}, True),
    ],
)
def test_step_socket_flags(
    spawn_server: SpawnServer, socket_path: Path, flags: list[str], environ: dict[str, str], served: bool
) -> None:
    server = spawn_server("CartPole-v1", 1, "--unix-socket", str(socket_path), *flags, environ=environ)
    assert server.address == f"unix:{socket_path}"
    assert Path(f"{socket_path}{STEP_SOCKET_SUFFIX}").is_socket() is served


def test_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "env_server", "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("env-server (envfleet) "), proc
    # The commit where it is known (the version is the same at every commit), then the protocol.
    commit = source_commit()
    said = f" (commit {commit[:12]}{commit[40:]})" if commit else ""
    assert proc.stdout.endswith(f"{said}, protocol envfleet.v1 version {PROTOCOL_VERSION}\n"), proc.stdout
    # Not installed (as in the images, which run the source with pyproject.toml beside it): the
    # version in pyproject.toml, said to be so; it read "(not installed)" alone.
    import importlib.metadata
    import tomllib

    from env_server.protocol import package_version

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert package_version.__wrapped__() == f"{pyproject['project']['version']} (not installed)"  # (not its cache)
    # ... but not another project's (the package copied beside its pyproject.toml)
    project = tmp_path / "other"
    (project / "env_server").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    monkeypatch.setattr("env_server.protocol.__file__", str(project / "env_server" / "protocol.py"))
    assert package_version.__wrapped__() == "(not installed)"


def test_a_unix_socket_another_server_listens_on_is_refused_and_a_stale_one_replaced(
    spawn_server: SpawnServer, socket_path: Path
) -> None:
    """gRPC would replace the first server's socket, taking its learners over and leaving it unreachable."""
    first = spawn_server("CartPole-v1", 1, "--unix-socket", str(socket_path))
    result = run_server("--env", "Acrobot-v1", "--unix-socket", str(socket_path))
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.strip().splitlines()[-1] == (
        f"env-server: error: --unix-socket {socket_path}: another server is listening there; stop it or pick another path"
    )
    assert socket_path.is_socket() and Path(f"{socket_path}{STEP_SOCKET_SUFFIX}").is_socket()
    first.kill()  # SIGKILL: its socket files stay behind, stale
    assert socket_path.is_socket()
    second = spawn_server("Acrobot-v1", 1, "--unix-socket", str(socket_path))
    assert second.address == f"unix:{socket_path}"


def test_what_is_served_is_logged_and_risky_or_ignored_settings_warned() -> None:
    logs = started_logs(
        "--num-envs", "2", "--env-kwargs", '{"max_episode_steps": 20}', "--step-delay-ms", "1",
        "--spin-wait-ms", "0.5", "--host", "0.0.0.0",
    )  # fmt: skip
    assert 'serving 2 x CartPole-v1 (sync; kwargs {"max_episode_steps": 20}; step delay 1 ms) on 0.0.0.0:' in logs
    assert "with neither TLS nor an auth token: anyone who reaches it can claim and step its envs" in logs
    assert "--spin-wait-ms applies to the step socket only" in logs
    quiet = started_logs("--auth-token", "t0ken", "--host", "0.0.0.0")
    assert "neither TLS nor an auth token" not in quiet and "spin-wait" not in quiet


def test_a_set_variable_no_envfleet_command_reads_is_warned_of_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo of ENVFLEET_TLS_CLIENT_CA served without mutual TLS, and said nothing (as does a variable of an
    option this server is too old for). Warned of, once each, sorted; not those of other envfleet commands,
    which the same environment (a compose .env file) carries."""
    for name in [n for n in os.environ if n.startswith("ENVFLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CAS", "/no/such/ca.crt")
    monkeypatch.setenv("ENVFLEET_A_NEWER_OPTION", "s3cret")
    monkeypatch.setenv("ENVFLEET_NUM_ENVS", "2")  # env-server's
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CERT", "/client.crt")  # the learner's and the health probe's
    monkeypatch.setenv("ENVFLEET_REPLICAS", "3")  # docker-compose.yml's
    logs = started_logs()
    warned = [line.partition("WARNING env_server.__main__: ")[2] for line in logs.splitlines() if "is set, but" in line]
    assert warned == [
        "ENVFLEET_A_NEWER_OPTION is set, but no envfleet option reads it: ignored "
        "(a typo, or an option of a newer envfleet?)",
        "ENVFLEET_TLS_CLIENT_CAS is set, but no envfleet option reads it: ignored "
        "(did you mean ENVFLEET_TLS_CLIENT_CA?)",
    ], logs
    assert "serving 2 x CartPole-v1" in logs and "s3cret" not in logs


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (PermissionError(errno.EACCES, "Permission denied"), "a socket this user may not connect to"),
        (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), "another server is listening there"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), None),  # stale: replaced
    ],
)
def test_a_socket_that_cannot_be_probed_is_not_taken_for_stale(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch, error: OSError, message: str | None
) -> None:
    """(root connects to any socket: another user's is simulated by what connect raises)"""
    from env_server.server import _check_socket_path

    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(socket_path))  # a socket file, nothing listening

    def connect(self: socket.socket, address: Any) -> None:
        raise error

    monkeypatch.setattr(socket.socket, "connect", connect)
    if message is None:
        _check_socket_path(str(socket_path))
    else:
        with pytest.raises(OSError, match=message):
            _check_socket_path(str(socket_path))


@pytest.mark.slow
def test_a_server_stopped_while_building_never_says_it_is_ready(tmp_path: Path) -> None:
    log = tmp_path / "log"
    argv = [sys.executable, "-m", "env_server", "--env", "tests.envs:SlowToBuildEnv", "--port", "0"]
    argv += ["--env-kwargs", '{"build_s": 3}', "--log-level", "info"]
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 30
        while "building 1 x tests.envs:SlowToBuildEnv" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and stdout == "", (proc.returncode, stdout)
    text = log.read_text()
    assert "stopped while building its envs" in text and "serving " not in text, text


# -- --wrappers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "environ", "given"),
    [
        (["--wrappers", "atari,atari"], None, "atari,atari"),
        ([], {"ENVFLEET_WRAPPERS": "clip-action, flatten,clip-action"}, "clip-action, flatten,clip-action"),
    ],
)
def test_a_wrapper_named_twice_is_refused_at_start(args: list[str], environ: dict[str, str] | None, given: str) -> None:
    # (a second 'atari' preprocessed 84x84 frames again: every reset failed, once the server served)
    result = run_server("--env", "ALE/Pong-v5", "--port", "0", *args, environ=environ)
    twice = given.split(",")[0].strip()
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.strip().splitlines() == [
        SHORT_USAGE,
        "env-server: error: --wrappers (or ENVFLEET_WRAPPERS): expected each wrapper at most once (each applies "
        f"once), got {twice!r} twice in {given.replace(' ', '')!r}",
    ]
    # (the same for a ServerConfig made in code)
    with pytest.raises(ValueError, match=r"^wrappers: expected each wrapper at most once .* 'flatten' twice in"):
        ServerConfig(env="CartPole-v1", wrappers=("flatten", "flatten"))


def test_the_flatten_wrapper_serves_dict_observations_as_one_box(start_servers: StartServers) -> None:
    """For learners that take Box observations only (learner train): gymnasium's FlattenObservation."""
    (address,) = start_servers("tests.envs:DictEnv", 1, 2, server_args=["--wrappers", "flatten"])
    flat_space = gym.spaces.flatten_space(DictEnv().observation_space)
    local = gym.vector.SyncVectorEnv([lambda: gym.wrappers.FlattenObservation(DictEnv())] * 2)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(20, 2, 2)).astype(np.float32)
    with RemoteVectorEnv([address]) as envs:
        assert envs.single_observation_space == flat_space and isinstance(flat_space, gym.spaces.Box)
        assert flat_space.shape == (56,)  # 3 + 32 + 5 (one-hot) + 4 + (3 + 4) + (3 + 2)
        runs = []
        for vec in (envs, local):
            obs, _ = vec.reset(seed=4)
            runs.append([obs] + [vec.step(a)[0] for a in actions])
    local.close()
    for remote, expected in zip(*runs, strict=True):
        assert remote.shape == (2, 56)
        np.testing.assert_array_equal(remote, expected)
    # A flat observation unflattens to one of the env's own (its Discrete parts were one-hot).
    assert DictEnv().observation_space.contains(gym.spaces.unflatten(DictEnv().observation_space, runs[0][0][0]))


def test_the_flatten_wrapper_refuses_a_space_it_cannot_flatten_to_a_box() -> None:
    class SequenceEnv(gym.Env[Any, Any]):
        observation_space = gym.spaces.Sequence(gym.spaces.Discrete(3))
        action_space = gym.spaces.Discrete(2)

    with pytest.raises(
        EnvBuildError, match=r"^wrapper 'flatten': expected an observation space that flattens to a Box"
    ):
        WRAPPERS["flatten"](SequenceEnv())


def test_a_server_whose_stdout_cannot_be_written_serves_all_the_same(tmp_path: Path) -> None:
    """Its "listening on" line to a full disk (or to a reader that left) ended the server at start with
    "env-server: error: [Errno 28] No space left on device" (naming no stdout); a learner saw nothing listen."""
    sock = tmp_path / "s.sock"
    argv = [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--unix-socket", str(sock)]
    with open("/dev/full", "w") as full, open(tmp_path / "err.txt", "w+") as err:
        proc = subprocess.Popen(argv, stdout=full, stderr=err, text=True)
        try:
            with RemoteVectorEnv([f"unix:{sock}"], connect_timeout=60) as envs:
                envs.reset(seed=0)
            assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        err.seek(0)
        said = err.read()
    assert (
        f"could not write 'listening on unix:{sock}' to stdout (No space left on device); serving all the same" in said
    )


@needs_proc
def test_the_server_raises_its_soft_limit_on_open_files_to_the_hard_one(tmp_path: Path) -> None:
    """As the learner does: --vectorization async holds about 3 a worker, and under a soft limit of 1024 a
    server stopped at ~330 envs ("cannot start worker process 17 of 40" under 64), the hard limit far higher."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.skip(f"the hard limit on open files is {hard}")
    sock = tmp_path / "s.sock"
    server = (
        f"exec {shlex.quote(sys.executable)} -m env_server --env CartPole-v1 --unix-socket {shlex.quote(str(sock))}"
    )
    argv = ["sh", "-c", f"ulimit -Sn 64 && {server}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("listening on")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
        assert int(line.split()[3]) > 64, line
    finally:
        proc.terminate()
        proc.wait(timeout=30)
