"""Servers whose answers break the wire contract, as one written from the proto alone may: a fault-tolerant
fleet takes one unreadable answer for an outage, but a server whose answers cannot be read again right
after it came back is broken, and raises (was: reconnected for good, `learner train` "succeeding" with
half of its env steps lost); and the envs' values training cannot use (NaN) name their server and end
as the other errors that stop a run do, with how to go on from its checkpoint.

``python -m tests.test_wire_faults ENV-SERVER-ARGS`` is such a server: an env-server (ARGS as env-server's)
that answers the steps ``$SHORT_STEPS`` lists (its own count, from 1: ``2,6``; ``3-``: the 3rd and all
after), and the resets ``$SHORT_RESETS`` lists, with one observation fewer than its envs, as the
reviewer's server in another language did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import numpy as np
import pytest

from env_server import codec, service
from env_server.rpc import env_pb2 as pb
from env_server.service import EnvService
from learner import InvalidResponseError, RemoteEnvError, RemoteVectorEnv, SessionError, rundir
from learner.faults import Replica, reconnect
from tests.conftest import FAST as FAST_CALLS
from tests.conftest import SpawnServer

K = 2  # envs per server
FAST: dict[str, Any] = {**FAST_CALLS, "timeout": 5.0}
SHORT_STEPS = "SHORT_STEPS"

SHORT_RESETS = "SHORT_RESETS"

ShortServer = Callable[..., str]


def _chosen(which: str) -> Callable[[int], bool]:
    """Whether the n-th call (from 1) is one of ``which`` ("2,6"; "3-": the 3rd and all after; "": none)."""
    if which.endswith("-"):
        return lambda n: n >= int(which[:-1])
    listed = {int(n) for n in which.split(",") if n}
    return lambda n: n in listed


def _cut(response: Any) -> Any:
    """``response`` (a step's or a reset's) with the last env's observation left out."""
    obs = np.asarray(codec.decode_value(response.observations, "observations"))
    response.observations.Clear()
    codec.encode_value(obs[:-1], response.observations, "observations")
    return response


def _short_answers(steps: str, resets: str) -> None:
    """Make EnvService answer the steps and resets ``steps`` and ``resets`` name (see the module's
    docstring) with one observation too few."""
    step_response, encode_reset = EnvService._step_response, service._encode_reset
    short_step, short_reset = _chosen(steps), _chosen(resets)
    made = {"resets": 0}

    def step(self: EnvService, *args: Any, **kwargs: Any) -> Any:
        response = step_response(self, *args, **kwargs)
        return _cut(response) if short_step(self.steps) else response

    def reset(*args: Any, **kwargs: Any) -> Any:
        made["resets"] += 1
        response = encode_reset(*args, **kwargs)
        return _cut(response) if short_reset(made["resets"]) else response

    EnvService._step_response = step  # type: ignore[method-assign]
    service._encode_reset = reset


@contextlib.contextmanager
def _servers_of(module: str) -> Iterator[Callable[[dict[str, str] | None], str]]:
    """``start(env)`` -> the address of a new server of CartPole-v1 (K envs), ``python -m module`` on port 0
    (``env``: its environment, else this one's); all of them killed when the block ends."""
    started: list[subprocess.Popen[str]] = []

    def start(env: dict[str, str] | None = None) -> str:
        argv = [sys.executable, "-m", module, "--env", "CartPole-v1", "--num-envs", str(K)]
        proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        return line.removeprefix("listening on ")

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=30)
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.fixture
def short_server() -> Iterator[ShortServer]:
    """``short_server(steps, resets="")`` -> the address of a server of CartPole-v1 (K envs) that answers
    ``steps`` and ``resets`` short."""
    with _servers_of("tests.test_wire_faults") as start:
        yield lambda steps, resets="": start({**os.environ, SHORT_STEPS: steps, SHORT_RESETS: resets})


@pytest.fixture
def old_server() -> Iterator[Callable[[], str]]:
    """``old_server()`` -> the address of a server as envfleet's first versions served (tests.old_server:
    Handshake and Reset, and every step answered UNIMPLEMENTED, as gRPC answers for a method it lacks)
    of CartPole-v1, K envs."""
    with _servers_of("tests.old_server") as start:
        yield lambda: start(None)


def _unavailable(infos: dict[str, Any]) -> list[bool]:
    return np.asarray(infos.get("_env_unavailable", np.zeros(2 * K, dtype=bool))).tolist()


def _broken_again_after_reset(envs: RemoteVectorEnv, error: type[BaseException], match: str, deadline: float) -> None:
    """The next reset tries the broken server (B, the second K envs) again: A's envs go on, B's are unavailable
    while it is reconnected, and, still broken, its step raises ``error`` (``match``) again: 3 failures in
    all, 2 reconnects, B down."""
    _, infos = envs.reset(seed=1)
    assert _unavailable(infos) == [False] * K + [True] * K
    with pytest.raises(error, match=match):
        while time.monotonic() < deadline:
            *_, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
            assert not any(_unavailable(infos)[:K])
            time.sleep(0.01)
    stats = envs.fault_stats()
    assert (stats.failures, stats.reconnects, stats.servers_down) == (3, 2, 1)


# ---------------------------------------------------------------------------------------------
# Answers that cannot be read


@pytest.mark.slow
def test_a_server_whose_answers_cannot_be_read_again_after_a_reconnect_is_broken_not_lost(
    spawn_server: SpawnServer, short_server: ShortServer
) -> None:
    a, b = spawn_server("CartPole-v1", K).address, short_server("1-")
    actions = np.zeros(2 * K, dtype=np.int64)
    with RemoteVectorEnv([a, b], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        _, _, _, truncs, infos = envs.step(actions)  # the first: an outage (B lost, its episodes cut)
        assert truncs[K:].all() and _unavailable(infos) == [False] * K + [True] * K
        deadline = time.monotonic() + 20
        with pytest.raises(InvalidResponseError) as info:
            while time.monotonic() < deadline:  # (B comes back, hands over its reset, and answers short again)
                envs.step(actions)
                time.sleep(0.01)
        text = str(info.value)
        assert text == (
            f"env server {b}: Step: its answer could not be read (ValueError: observations: expected a batch of shape "
            f"({K}, 4) ({K} envs), got shape ({K - 1}, 4)); is it a server of another envfleet version? The server is "
            "broken, not out: 2 of its answers in a row could not be read, the last right after a reconnect, with no "
            "step answered between: a server that does not keep to the envfleet.v1 protocol (another version, or a "
            "bug); it is not reconnected (fault tolerance would go on without its envs "
            f"{K}-{2 * K - 1} for good) until the next reset, which tries it again: fix or replace it"
        )
        assert info.value.address == b and isinstance(info.value.__cause__, InvalidResponseError)
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.servers_down) == (2, 1, 1)
        # As after any failed step: the fleet needs a reset, which tries B again: A's envs go on, B's are
        # unavailable while it is reconnected, and, still answering short, it raises again.
        with pytest.raises(SessionError, match="reset"):
            envs.step(actions)
        _broken_again_after_reset(envs, InvalidResponseError, r"broken, not out: 3 of its answers in a row", deadline)


@pytest.mark.slow
def test_a_server_whose_reset_cannot_be_read_after_a_reconnect_is_broken_too(
    spawn_server: SpawnServer, short_server: ShortServer
) -> None:
    """Its first step answered short, then the reset of its reconnect, handed over at the next step."""
    a, b = spawn_server("CartPole-v1", K).address, short_server("1", "2-")
    actions = np.zeros(2 * K, dtype=np.int64)
    with RemoteVectorEnv([a, b], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        *_, infos = envs.step(actions)
        assert _unavailable(infos) == [False] * K + [True] * K
        deadline = time.monotonic() + 20
        with pytest.raises(InvalidResponseError, match=rf"^env server {b}: Reset: its answer could not be read .*"):
            while time.monotonic() < deadline:
                envs.step(actions)
                time.sleep(0.01)
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.servers_down) == (2, 1, 1)


@pytest.mark.slow
def test_answers_that_cannot_be_read_now_and_then_are_outages(
    spawn_server: SpawnServer, short_server: ShortServer
) -> None:
    """Its steps 2 and 6 short: lost twice, but with steps answered between, each time a one-off."""
    a, b = spawn_server("CartPole-v1", K).address, short_server("2,6")
    actions = np.zeros(2 * K, dtype=np.int64)
    with RemoteVectorEnv([a, b], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        deadline = time.monotonic() + 20
        steady = 0  # steps in a row with B's envs available, after its second loss
        while steady < 5:
            assert time.monotonic() < deadline, envs.fault_stats()
            *_, infos = envs.step(actions)
            back = envs.fault_stats().reconnects == 2 and not any(_unavailable(infos))
            steady = steady + 1 if back else 0
            time.sleep(0.01)
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.servers_down) == (2, 2, 0)


@pytest.mark.slow
@pytest.mark.needs_torch
def test_learner_train_stops_at_a_broken_server_saying_how_to_go_on(
    spawn_server: SpawnServer, short_server: ShortServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reviewer's run: one of two servers answering every step with too few observations; `learner train`
    (fault-tolerant) ended with rc 0 after 18 failures and 17 reconnects, 49.9 % of its env steps lost."""
    from learner.cli import main

    a, b = spawn_server("CartPole-v1", K).address, short_server("20-")  # (after 2 updates: checkpoints)
    run = tmp_path / "run"
    argv = ["train", "--servers", f"{a},{b}", "--num-steps", "8", "--total-timesteps", "100000", "--seed", "0"]
    argv += ["--run-dir", str(run), "--checkpoint-seconds", "0", "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"learner train: error: env server {b}: Step: its answer could not be read (" in err, err
    assert "The server is broken, not out: 2 of its answers in a row could not be read" in err, err
    assert err.rstrip().splitlines()[-1].startswith(
        "  once that is mended, continue from its last checkpoint, step-"
    ) and err.rstrip().endswith(f"with: learner train --resume {run}"), err
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"].startswith(f"error: InvalidResponseError: env server {b}: Step:")
    assert (summary["failures"], summary["reconnects"]) == (2, 1)


# ---------------------------------------------------------------------------------------------
# Servers that serve no StepStream (envfleet's first versions)


def _no_step_stream(address: str, envs: str) -> str:
    """The error a fault-tolerant fleet raises for the old server at ``address`` (its envs ``envs``)."""
    return (
        f"env server {address}: Step failed [UNIMPLEMENTED]: it serves no StepStream, which this learner steps on: "
        "an envfleet.v1 server must serve it for the Python learner (envfleet's own first versions did not: "
        "upgrade those) (Method not found!). The server is broken, not out: it answered UNIMPLEMENTED 2 times in "
        "a row, the last right after a reconnect, with no step answered between: it does not serve a call this "
        "learner makes (a server of an older envfleet version, or one written from the proto without it), which "
        "no reconnect mends; it is not reconnected (fault tolerance would go on without its envs "
        f"{envs} for good) until the next reset, which tries it again: upgrade or replace it"
    )


@pytest.mark.slow
def test_a_server_without_step_stream_is_broken_not_lost(
    spawn_server: SpawnServer, old_server: Callable[[], str]
) -> None:
    """The reviewer's fleet of one new and one old server: the old one's every step failed UNIMPLEMENTED
    ("it serves no StepStream ... upgrade those"), and fault tolerance took that for an outage: "is back
    after 0.0 s", "lost again soon after coming back", reconnected for good, half of the run's env steps lost."""
    a, b = spawn_server("CartPole-v1", K).address, old_server()
    actions = np.zeros(2 * K, dtype=np.int64)
    with RemoteVectorEnv([a, b], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        *_, infos = envs.step(actions)  # the first: an outage (an HTTP proxy may answer UNIMPLEMENTED once)
        assert _unavailable(infos) == [False] * K + [True] * K
        deadline = time.monotonic() + 20
        with pytest.raises(RemoteEnvError) as info:
            while time.monotonic() < deadline:  # (B comes back, hands over its reset, and fails its step again)
                envs.step(actions)
                time.sleep(0.01)
        assert str(info.value) == _no_step_stream(b, f"{K}-{2 * K - 1}")
        assert info.value.address == b and info.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert isinstance(info.value.__cause__, RemoteEnvError)
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.servers_down) == (2, 1, 1)
        # The next reset tries it again (upgraded in place, it would rejoin); still old, its first step raises.
        _broken_again_after_reset(envs, RemoteEnvError, r"it answered UNIMPLEMENTED 3 times in a row", deadline)


@pytest.mark.slow
@pytest.mark.parametrize("fleet", ["old", "new,old"])
@pytest.mark.needs_torch
def test_learner_train_stops_at_a_server_without_step_stream(
    spawn_server: SpawnServer,
    old_server: Callable[[], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    fleet: str,
) -> None:
    """The reviewer's runs: with every server old, `learner train` ended in NothingToLearnError ("every env's
    server was unavailable ... (see the warnings above)"), naming no version; with one old and one new, it
    ended with rc 0 after "6 server failures, 5 reconnects, 4,096 env steps lost (50.0% of the run's)"."""
    from learner.cli import main

    servers = [spawn_server("CartPole-v1", K).address if kind == "new" else old_server() for kind in fleet.split(",")]
    old = servers[-1]
    run = tmp_path / "run"
    argv = ["train", "--servers", ",".join(servers), "--num-steps", "8", "--total-timesteps", "4096", "--seed", "0"]
    argv += ["--run-dir", str(run), "--checkpoint-seconds", "0", "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    envs = f"{K}-{2 * K - 1}" if len(servers) == 2 else f"0-{K - 1}"
    assert f"learner train: error: {_no_step_stream(old, envs)}" in err, err
    assert "NothingToLearnError" not in err and "every env's server was unavailable" not in err, err
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"].startswith(f"error: RemoteEnvError: env server {old}: Step failed [UNIMPLEMENTED]")
    assert (summary["failures"], summary["reconnects"]) == (2, 1)
    assert summary["total_steps"] < 4096


# ---------------------------------------------------------------------------------------------
# Values training cannot use


def test_the_server_of_an_env_is_named_from_the_fleets_env_slices() -> None:
    from learner.envs import env_server_of

    fleet = SimpleNamespace(addresses=["a:1", "b:2"], env_slices=[slice(0, 2), slice(2, 5)])
    assert [env_server_of(fleet, i) for i in (0, 1, 2, 4)] == ["env server a:1: "] * 2 + ["env server b:2: "] * 2
    assert env_server_of(SimpleNamespace(num_envs=2), 1) == ""  # in-process envs: no server to name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("reward", "reward of env 1 is nan, returned by its step at the run's env step 40: PPO cannot learn"),
        ("nan", "observation of env 1 has NaN or infinite values ([nan]; observation space Box"),
    ],
)
@pytest.mark.needs_torch
def test_learner_train_stopped_by_a_nan_names_its_server_and_says_how_to_go_on(
    spawn_server: SpawnServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, problem: str
) -> None:
    """Was: "reward of env 0 is nan ..." with no server, and no `--resume` line after it (a plain ValueError)."""
    from learner.cli import main

    # (seed 0: env i is reset with seed i, and BadObservationEnv goes bad where that is odd: env 1, on b)
    kwargs = ["--env-kwargs", f'{{"kind": "{kind}", "at": 20}}']
    a, b = (spawn_server("tests.envs:BadObservationEnv", 1, *kwargs).address for _ in range(2))
    run = tmp_path / "run"
    argv = ["train", "--servers", f"{a},{b}", "--num-steps", "8", "--total-timesteps", "100000", "--seed", "0"]
    argv += ["--run-dir", str(run), "--checkpoint-seconds", "0", "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"learner train: error: env server {b}: {problem}" in err, err
    assert err.rstrip().splitlines()[-1].startswith(
        "  once that is mended, continue from its last checkpoint, step-"
    ) and err.rstrip().endswith(f"with: learner train --resume {run}"), err


if __name__ == "__main__":
    from env_server.__main__ import main as serve

    _short_answers(os.environ[SHORT_STEPS], os.environ[SHORT_RESETS])
    sys.exit(serve())


def test_answers_out_of_step_count_toward_broken_only_with_another_such_answer() -> None:
    """From the diff's review: once a server had answered out of step twice (and was mended), any one
    unreadable answer later, hours of good steps between, made it broken, its text counting "1 of its
    answers in a row"."""
    replica = Replica(client=SimpleNamespace(), spec=pb.EnvSpec())  # type: ignore[arg-type]
    twice = InvalidResponseError("an answer to another request", address="a:1")
    twice.out_of_step = True
    assert not replica.broken_by(twice)
    replica.note_answer()
    assert replica.broken_by(twice)  # (a second one, steps answered between or not)
    replica.note_answer()
    assert not replica.broken_by(InvalidResponseError("could not be read", address="a:1"))  # (a one-off: an outage)


def test_unimplemented_counts_toward_broken_only_in_a_row() -> None:
    """A step answered UNIMPLEMENTED once is an outage (an HTTP proxy answering 404 for a moment, which gRPC
    reads as UNIMPLEMENTED); again right after a reconnect, no step answered between, the server is broken."""
    replica = Replica(client=SimpleNamespace(), spec=pb.EnvSpec())  # type: ignore[arg-type]
    unimplemented = RemoteEnvError("no StepStream", address="a:1", code=grpc.StatusCode.UNIMPLEMENTED)
    assert not replica.broken_by(unimplemented)
    replica.note_answer()  # (a step answered between: the first was a one-off)
    assert not replica.broken_by(unimplemented)
    assert not replica.broken_by(RemoteEnvError("timed out", address="a:1", code=grpc.StatusCode.DEADLINE_EXCEEDED))
    assert replica.broken_by(unimplemented)


def test_a_reconnect_to_an_address_that_now_serves_no_envfleet_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its address answered by another gRPC server (UNIMPLEMENTED: another service, or an older protocol):
    the operator's to fix, warned of at the first attempt, not only in the "still down" line now and then."""
    said = "env server s:1: GetSpec failed [UNIMPLEMENTED]: it answers gRPC but not GetSpec"
    attempts: list[int] = []

    class ServesNoEnvfleet:
        address = "s:1"

        async def wait_ready(self) -> None:
            pass

        async def get_spec(self) -> None:
            attempts.append(1)
            if len(attempts) == 3:
                raise asyncio.CancelledError  # (the fleet closes)
            raise RemoteEnvError(said, address="s:1", code=grpc.StatusCode.UNIMPLEMENTED)

        def abandon(self) -> None:
            pass

    replica = Replica(client=cast(Any, ServesNoEnvfleet()), spec=pb.EnvSpec())
    caplog.set_level(logging.DEBUG, logger="learner.faults")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(reconnect(replica, timeout=1.0, connect_timeout=1.0, backoff=(0.001, 0.002), on_ready=lambda: None))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("reconnect to s:1")]
    assert lines == [
        (logging.WARNING, f"reconnect to s:1, attempt 1: {said}"),
        (logging.DEBUG, f"reconnect to s:1, attempt 2: {said}"),
    ]
