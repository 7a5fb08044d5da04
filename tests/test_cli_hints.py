"""The advice of a passed deadline (and the library's other hints that name RemoteVectorEnv's arguments:
TLS, the wait for servers) in ``learner train``'s, ``learner eval``'s and ``learner servers``' own
options, while the library keeps its arguments' names."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import RemoteTimeoutError, RemoteVectorEnv
from learner.cli import _option_hints, _reworded, main
from learner.client import status_error, timeout_error
from learner.discovery import CLIENT_CERT_REQUIRED, TLS_CAUSE
from learner.evaluate import evaluate
from learner.remote import FAULT_TOLERANT_HINT
from learner.survey import survey
from tests.certs import make_server_certs
from tests.conftest import QUIET_FLAGS as QUIET
from tests.conftest import SpawnServer, StartServers, slow_to_build_server

# An env server of one env that takes 3 s to reset from its first reset on: past a 1 s deadline.
SLOW_RESET = {"slow_from": 1, "sleep_s": 3.0}
# A backquoted argument name, as the library's hints write them.
ARGUMENT = re.compile(r"`[a-z_]+`")
# The library's TLS keywords (tls=PATH, tls_server_name, ...) and its pointer to train's options.
TLS_ARGUMENT = re.compile(r"\btls\w*=|\btls_[a-z_]+|learner train --")


@pytest.fixture(scope="module")
def slow_reset_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run on SlowResetEnv, trained in process on envs that are never slow (a second)."""
    run = tmp_path_factory.mktemp("runs") / "slow-reset"
    never = json.dumps({"slow_from": 10**9})
    steps = ["--num-envs", "1", "--num-steps", "8", "--total-timesteps", "16"]
    argv = ["train", "--env", "tests.envs:SlowResetEnv", "--env-kwargs", never, "--backend", "gym", *steps]
    assert main([*argv, "--run-dir", str(run), *QUIET]) == 0
    return run


@pytest.mark.slow
def test_train_says_raise_reset_timeout_as_its_option_in_the_warning_and_the_error(tmp_path: Path) -> None:
    """Its local server's env misses the 1 s reset deadline at every reset: the server is lost (a
    warning), and after --give-up-after 1 the run stops with an error whose last error is the
    reset's. Both say --reset-timeout, what a user of the command can raise."""
    argv = ["--env", "tests.envs:SlowResetEnv", "--env-kwargs", json.dumps(SLOW_RESET), "--reset-timeout", "1"]
    argv += ["--give-up-after", "1", "--num-servers", "1", "--envs-per-server", "1"]
    argv += ["--num-steps", "8", "--total-timesteps", "16", "--run-dir", str(tmp_path / "run"), *QUIET]
    proc = subprocess.run(
        [sys.executable, "-m", "learner", "train", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    warning = next(line for line in lines if " WARNING learner.remote: env server " in line)
    error = next(line for line in lines if line.startswith("learner train: error: "))
    for line in (warning, error):
        assert "Reset failed [DEADLINE_EXCEEDED]: no answer within the 1 s deadline" in line, line
        assert "; raise --reset-timeout if the env is slow to reset" in line, line
    assert "reset_timeout" not in proc.stderr, proc.stderr


def test_remote_vector_env_s_reset_deadline_error_still_names_its_argument(start_servers: StartServers) -> None:
    (slow,) = start_servers("tests.envs:SlowResetEnv", env_kwargs={"slow_from": 1, "sleep_s": 1.5})
    with RemoteVectorEnv([slow], timeout=10.0, reset_timeout=0.5) as envs, pytest.raises(RemoteTimeoutError) as raised:
        envs.reset(seed=0)
    assert str(raised.value).endswith("; raise `reset_timeout` if the env is slow to reset"), raised.value
    assert "--reset-timeout" not in str(raised.value)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.slow
def test_a_step_past_the_reset_deadline_says_to_raise_reset_timeout(
    start_servers: StartServers, transport: str
) -> None:
    """A step in which an env autoresets has the reset deadline (reset_timeout, longer than timeout):
    missed, its advice is to raise that, not timeout (over gRPC and on the step socket alike)."""
    # (ClockEnv's episodes last 3 steps: the 4th step resets, from the second reset on 3 s long)
    (slow,) = start_servers("tests.envs:SlowResetEnv", env_kwargs={"slow_from": 2, "sleep_s": 3.0}, transport=transport)
    with RemoteVectorEnv([slow], timeout=1.0, reset_timeout=2.0) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.zeros(1, dtype=np.int64))
        with pytest.raises(RemoteTimeoutError) as raised:
            envs.step(np.zeros(1, dtype=np.int64))
    assert "no answer within the 2 s deadline" in str(raised.value), raised.value
    assert str(raised.value).endswith("; raise `reset_timeout` if the env is slow to reset"), raised.value


@pytest.mark.slow
def test_eval_says_raise_timeout_as_its_option_for_a_reset_and_evaluate_as_its_argument(
    slow_reset_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Eval has no --reset-timeout: its --timeout (evaluate()'s ``timeout``) is the resets' deadline too.
    The error comes at the first reset, before any episode finished: no result is printed."""
    slow = ["--env-kwargs", json.dumps(SLOW_RESET)]
    capsys.readouterr()
    assert main(["eval", str(slow_reset_run), "--episodes", "2", "--num-envs", "1", "--timeout", "1", *slow]) == 1
    out, err = capsys.readouterr()
    assert not out, out
    assert "Reset failed [DEADLINE_EXCEEDED]: no answer within the 1 s deadline" in err, err
    assert err.rstrip().endswith("; raise --timeout if the env is slow to reset"), err
    assert not ARGUMENT.search(err) and "reset_timeout" not in err and "--reset-timeout" not in err
    with pytest.raises(RemoteTimeoutError) as raised:
        evaluate(slow_reset_run, 2, num_envs=1, timeout=1.0, env_kwargs=SLOW_RESET, progress=False)
    assert str(raised.value).endswith("; raise `timeout` if the env is slow to reset"), raised.value
    partial = raised.value.partial_result
    assert partial is not None and (partial["episodes"], partial["episodes_asked"]) == (0, 2)
    assert partial["return_mean"] is None and partial["returns"] == []


def test_every_hint_that_names_an_argument_names_the_command_s_option_instead() -> None:
    """The library's messages with such hints (a step's and a reset's deadline, a keepalive ping's, an
    env's error when not fault-tolerant), as train and eval print them: no argument name is left."""
    step = str(timeout_error(address="a:1", method="Step", timeout=2.0))
    reset = str(
        status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", address="a:1", method="Reset", timeout=2.0)
    )
    ping = str(
        status_error(grpc.StatusCode.UNAVAILABLE, "ping timeout", address="a:1", method="Step", from_server=False)
    )
    crashed = f"env server a:1: env 0 raised in step: ValueError: no (the server reset it; {FAULT_TOLERANT_HINT})"
    for message in (step, reset, ping, crashed):
        assert ARGUMENT.search(message) or "fault_tolerant" in message, message  # (the library's own words)
    train = [_reworded(m, _option_hints("train")) for m in (step, reset, ping, crashed)]
    assert train[0].endswith("; raise --timeout if the env is slow"), train[0]
    assert train[1].endswith("; raise --reset-timeout if the env is slow to reset"), train[1]
    assert "big observations on a slow link: raise --keepalive-timeout, 5 s by default, or have the servers" in train[2]
    assert train[3].endswith(
        "(the server reset it; with --fault-tolerant, the default, only this env's episode would be cut short)"
    )
    eval_ = [_reworded(m, _option_hints("eval")) for m in (step, reset, ping, crashed)]
    assert eval_[0].endswith("; raise --timeout if the env is slow"), eval_[0]
    assert eval_[1].endswith("; raise --timeout if the env is slow to reset"), eval_[1]
    assert "raise --keepalive-timeout, 5 s by default" in eval_[2]
    assert eval_[3].endswith(
        "(the server reset it; eval stops at an env's error, as an episode cut short is no sample)"
    )
    servers = _reworded(step, _option_hints("servers"))  # (GetSpec's deadline: --timeout)
    assert servers.endswith("; raise --timeout if the env is slow"), servers
    for message in (*train, *eval_, servers):
        assert not ARGUMENT.search(message) and "fault_tolerant" not in message, message
    # The TLS hints name the argument and train's option; each command names its option alone.
    required = TLS_CAUSE + CLIENT_CERT_REQUIRED
    assert TLS_ARGUMENT.search(required), required
    for command in ("train", "eval", "servers"):
        said = _reworded(required, _option_hints(command))
        assert "(--tls-client-cert PATH --tls-client-key PATH, or $ENVFLEET_TLS_CLIENT_CERT and " in said, said
        assert not TLS_ARGUMENT.search(said), said


@pytest.mark.slow
def test_train_says_connect_timeout_and_tls_keywords_as_its_options_while_a_server_does_not_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens at the address: the start's warning that it waits names --connect-timeout; the
    error at its end, with TLS, what the server's certificate must hold, naming the TLS options."""
    # (bound, not listening, until the command has ended: closed at once, another process's listener could take
    # the port before the command tries it, an env server on port 0 of a test running beside this one)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"  # (nothing answers there)
        argv = ["train", "--servers", address, "--tls", "--connect-timeout", "3", "--run-dir", str(tmp_path / "run")]
        with caplog.at_level("WARNING", logger="learner"):
            assert main([*argv, *QUIET]) == 1
    waiting = [r.getMessage() for r in caplog.records if "not answering yet" in r.getMessage()]
    assert waiting and waiting[0].endswith("waiting up to 3 s in all (--connect-timeout)"), waiting
    assert not any("connect_timeout" in r.getMessage() for r in caplog.records)
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        "localhost for a unix: one; or --tls-server-name); a server that requires client certificates needs one "
        "(--tls-client-cert, --tls-client-key))"
    ), err
    assert not TLS_ARGUMENT.search(err), err


@pytest.mark.slow
def test_eval_says_connect_timeout_as_its_option_while_a_server_still_builds_its_envs(
    slow_reset_run: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Eval waits --connect-timeout for --servers, as train does; a server still building its envs
    after it is said with the option to raise, naming no argument."""
    with slow_to_build_server(60.0, 1) as slow:
        host, _, port = slow.rpartition(":")
        for _ in range(300):  # (listening: the wait is the handshake's, answered "starting")
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
                break
            time.sleep(0.1)
        with caplog.at_level("WARNING", logger="learner"):
            argv = ["eval", str(slow_reset_run), "--servers", slow, "--connect-timeout", "3", "--no-progress"]
            assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        "(still, after 3 s: raise --connect-timeout for servers that take long to build their envs)"
    ), err
    assert "connect_timeout" not in err and not ARGUMENT.search(err), err
    assert not any("connect_timeout" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_learner_servers_and_eval_name_the_tls_options_where_the_library_names_its_keywords(
    spawn_server: SpawnServer, slow_reset_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a TLS server refuses (plaintext, a CA not given, a name its certificate lacks), as learner
    servers says it (text and --json) and eval: their options, not survey()'s and RemoteVectorEnv's
    keywords, which survey() itself keeps."""
    certs = make_server_certs(tmp_path / "certs", names=("localhost",))  # (not the address's 127.0.0.1)
    server = spawn_server("CartPole-v1", 1, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    (surveyed,) = survey(server.address)
    assert surveyed.error.endswith("pass its CA (tls=..., learner train --tls-ca)"), surveyed.error
    for options, advice in (
        ([], "this client does not: pass its CA (--tls-ca)"),
        (["--tls"], "give the servers' CA with --tls-ca)"),
        (["--tls-ca", str(certs.ca)], "give that name: --tls-server-name NAME)"),
    ):
        assert main(["servers", server.address, *options]) == 1
        text = capsys.readouterr().out
        assert main(["servers", server.address, *options, "--json"]) == 1
        (info,) = json.loads(capsys.readouterr().out)
        for said in (text, info["error"]):
            assert advice in said and not TLS_ARGUMENT.search(said), said
    assert main(["eval", str(slow_reset_run), "--servers", server.address, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "this client does not: pass its CA (--tls-ca)" in err and not TLS_ARGUMENT.search(err), err


def test_local_servers_too_slow_to_build_name_the_command_s_option() -> None:
    """LocalServers' error names its argument and the commands' option; train and eval name the option alone."""
    from learner import LocalServers
    from learner.errors import ServerStartError

    with pytest.raises(ServerStartError) as info:
        LocalServers("tests.envs:SlowToBuildEnv", 1, 1, env_kwargs={"build_s": 30}, startup_timeout=0.5)
    message = str(info.value)
    assert "raise startup_timeout; learner train and eval: --connect-timeout" in message, message
    for command in ("train", "eval"):
        assert "(envs that take long to build: raise --connect-timeout)" in _reworded(message, _option_hints(command))
