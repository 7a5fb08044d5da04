"""Training on a fleet that changes under it: servers join and leave between rollouts, or fail in one."""

from __future__ import annotations

import dataclasses
import itertools
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import EnvCrashedError, ServerUnavailableError, rundir
from learner.cli import main
from learner.config import Args
from learner.discovery import register_resolver
from learner.train import NothingToLearnError, train
from tests.conftest import QUIET as QUIET_RUN
from tests.conftest import Serve, StartServers

# testfleet-train:N -> SCHEDULES[N](k) for the k-th look-up (1: when the envs are opened; k >= 2: before
# rollout k-1), so a test says exactly which servers each rollout sees.
SCHEDULES: dict[str, object] = {}
_calls: dict[str, itertools.count[int]] = {}


def _resolve(name: str) -> list[str]:
    schedule = SCHEDULES[name]
    assert callable(schedule)
    return list(schedule(next(_calls[name])))


register_resolver("testfleet-train", _resolve)


def scheduled(name: str, schedule: object) -> str:
    SCHEDULES[name] = schedule
    _calls[name] = itertools.count(1)
    return f"testfleet-train:{name}"


QUIET: dict[str, Any] = {**QUIET_RUN, "checkpoint_every": 0}


def test_num_envs_and_the_batch_follow_servers_that_join_and_leave(serve: Serve, tmp_path: Path) -> None:
    a, b = serve(num_envs=2)[1], serve(num_envs=2)[1]
    fleet = {1: [a], 2: [a], 3: [a, b], 4: [a, b], 5: [b], 6: [b]}
    servers = scheduled("grow-shrink", lambda k: fleet[min(k, 6)])
    run = tmp_path / "run"
    summary = train(
        Args(env="CartPole-v1", servers=servers, num_steps=16, total_timesteps=16 * 14, run_dir=str(run), **QUIET)
    )
    assert summary["stop_reason"] == "total_timesteps" and summary["total_steps"] == 16 * 14
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["num_envs"] for r in rows] == [2, 4, 4, 2, 2]
    # The batch is num_steps x num_envs, less the reset steps of next-step autoreset.
    assert all(r["batch_size"] <= 16 * r["num_envs"] for r in rows)
    assert rows[1]["batch_size"] > rows[0]["batch_size"]
    # Each server's figures are keyed by its address, so they follow it wherever it is in the fleet (b is
    # the second server, then the first).
    seen = [{k.removeprefix("replicas/").rpartition("/")[0] for k in r if k.startswith("replicas/")} for r in rows]
    assert seen == [{a}, {a, b}, {a, b}, {b}, {b}], seen
    assert [r[f"replicas/{b}/num_envs"] for r in rows[1:]] == [2, 2, 2, 2]
    assert summary["replicas"][a]["steps"] == 16 * 3 and summary["replicas"][b]["steps"] == 16 * 4


def test_learner_train_prints_one_line_per_fleet_change(
    serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = serve(num_envs=2)[1], serve(num_envs=2)[1], serve(num_envs=2)[1]
    fleet = {1: [a], 2: [a], 3: [a, b], 4: [a, b], 5: [b, c], 6: [b, c], 7: [c]}
    servers = scheduled("printed", lambda k: fleet[min(k, 7)])
    argv = ["train", "--servers", servers, "--num-steps", "8", "--total-timesteps", str(8 * (2 + 4 * 4 + 2))]
    argv += ["--run-dir", str(tmp_path / "run"), "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fleet:")]
    assert lines == [
        f"fleet: +2 envs (1 server joined: {b}); 4 envs now",
        f"fleet: +2 -2 envs (1 server joined: {c}; 1 server left: {a}); 4 envs now",
        f"fleet: -2 envs (1 server left: {b}); 2 envs now",
    ]


@pytest.mark.slow
def test_after_a_failed_step_the_line_counts_the_envs_of_the_server_that_left_and_those_restarted(
    serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """3 servers x 2 envs, not fault-tolerant; a hangs in the second rollout (its step times out): the
    rollout is dropped, a is let go, and the envs of b and c start over (they stepped unseen)."""
    (proc, a), (_, b), (_, c) = serve(num_envs=2), serve(num_envs=2), serve(num_envs=2)

    def fleet(k: int) -> list[str]:
        if k == 3:  # before the second rollout: a still accepts connections, but answers nothing
            proc.send_signal(signal.SIGSTOP)
        return [a, b, c] if k <= 3 else [b, c]

    # (--timeout 3: long enough that b and c, stalled by a busy machine, are not taken for hung too)
    argv = ["train", "--servers", scheduled("failed-step", fleet), "--num-steps", "8", "--timeout", "3"]
    argv += ["--no-fault-tolerant"]
    argv += ["--total-timesteps", str(8 * 6 + 8 * 4 * 2), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--no-progress", "--no-plot", "--no-tensorboard"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fleet:")]
    assert lines == [f"fleet: -2 envs (1 server left: {a}); 4 envs restarted; 4 envs now"]
    proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["plain", "fault-tolerant"])
@pytest.mark.slow
def test_a_server_that_hangs_mid_run_is_left_behind_and_training_goes_on(
    serve: Serve, tmp_path: Path, fault_tolerant: bool
) -> None:
    """A step to it times out. Plain: that rollout is dropped, the server let go, and the others train on.
    Fault-tolerant: its envs are unavailable (kept out of the batch) while the others train on."""
    (_, a), (proc, b) = serve(num_envs=2), serve(num_envs=2)

    def fleet(k: int) -> list[str]:
        if k == 3:  # before the second rollout: b still accepts connections, but answers nothing
            proc.send_signal(signal.SIGSTOP)
        return [a, b]  # and stays listed, as a hung replica may

    run = tmp_path / "run"
    name = f"hang-{fault_tolerant}"
    args = Args(env="CartPole-v1", servers=scheduled(name, fleet), num_steps=16, timeout=1.0, **QUIET)
    total = 16 * 4 * 4 if fault_tolerant else 16 * 4 + 16 * 2 * 3
    args = dataclasses.replace(args, total_timesteps=total, run_dir=str(run), fault_tolerant=fault_tolerant)
    summary = train(args)
    assert summary["stop_reason"] == "total_timesteps"
    rows = rundir.read_jsonl(run / rundir.METRICS)
    sizes = [r["num_envs"] for r in rows]
    if fault_tolerant:
        assert sizes == [4] * 4, sizes
        assert [r["envs_unavailable"] for r in rows] == [0, 2, 2, 2]
        assert all(r["batch_size"] <= 16 * 2 for r in rows[1:])  # b's steps are not in the batch
        assert summary["failures"] == 1
    else:
        assert sizes[0] == 4 and sizes[1:] == [2] * (len(sizes) - 1), sizes


@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["plain", "fault-tolerant"])
@pytest.mark.slow
def test_no_server_left_ends_the_run_with_an_error_naming_it(
    serve: Serve, tmp_path: Path, fault_tolerant: bool
) -> None:
    proc, a = serve("tests.envs:ClockEnv", num_envs=2)  # episodes of 3 steps: the plot has returns to show

    def fleet(k: int) -> list[str]:
        if k == 3:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        return [a]

    args = Args(
        env="tests.envs:ClockEnv",
        servers=scheduled(f"gone-{fault_tolerant}", fleet),
        num_steps=8,
        total_timesteps=10_000,
        fault_tolerant=fault_tolerant,
        give_up_after=2.0,
        **QUIET,
    )
    with pytest.raises(ServerUnavailableError, match=f"no env server left: {a}"):
        train(dataclasses.replace(args, run_dir=str(tmp_path / "run"), plot=True))
    assert rundir.read_json(tmp_path / "run" / rundir.SUMMARY)["stop_reason"].startswith("error")
    assert (tmp_path / "run" / rundir.PLOT).is_file()  # the update before it, as any run's end has


def test_without_fault_tolerance_an_env_that_raises_costs_its_rollout_and_every_env_starts_over(
    start_servers: StartServers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Env 0 raises in its 20th step: in the third rollout of 8 steps.
    (address,) = start_servers("tests.envs:FaultyEnv", 1, 2, env_kwargs={"raise_at": 20, "length": 100})
    args = Args(
        env="tests.envs:FaultyEnv",
        servers=address,
        num_steps=8,
        total_timesteps=64,
        fault_tolerant=False,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    summary = train(args)
    assert (  # (a server this process started: named as its forwarded lines are, env_server[local-0])
        "dropping this rollout, every env starts over: env server local-0: env 0 raised in step: ValueError: "
        "step 20 failed on purpose (env 0)"
    ) in caplog.text
    rows = rundir.read_jsonl(tmp_path / "run" / rundir.METRICS)
    # 2 rollouts, the third dropped at its fourth step, then the rest: 16 + 16 + (4 x 2 counted, the raise's step
    # too, as a fault-tolerant run counts it; not learned) + ...
    assert [r["global_step"] for r in rows][:3] == [16, 32, 56]
    assert summary["stop_reason"] == "total_timesteps" and summary["total_steps"] >= 64


def test_without_fault_tolerance_three_failed_rollouts_in_a_row_stop_the_run(
    start_servers: StartServers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """README: "a failure costs the whole rollout instead, with a warning ..., and three in a row stop
    the run" (it took four)."""
    (address,) = start_servers("tests.envs:BrokenStepEnv", 1, 2)
    args = Args(
        env="tests.envs:BrokenStepEnv",
        servers=address,
        num_steps=8,
        total_timesteps=10_000,
        fault_tolerant=False,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    with pytest.raises(EnvCrashedError):
        train(args)
    assert caplog.text.count("dropping this rollout") == 2


@pytest.mark.slow
def test_a_fleet_replaced_while_every_server_is_down_is_found_at_once(serve: Serve, tmp_path: Path) -> None:
    """Every server gone mid-rollout (compose down, then up with new replicas): the rollout ends there
    and the servers are looked up again, instead of stepping the rest of it at up to 1 s a step
    (64 here: past give_up_after, which ended runs whose new fleet was long healthy)."""
    (proc, a), (_, b) = serve(num_envs=2), serve(num_envs=2)

    def fleet(k: int) -> list[str]:
        if k == 3:  # a dies during the rollout after this look-up, while its address still resolves
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        return [a] if k <= 3 else [b]

    args = Args(
        env="CartPole-v1",
        servers=scheduled("replaced", fleet),
        num_steps=64,
        total_timesteps=5 * 128,
        give_up_after=10.0,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    summary = train(args)
    assert summary["stop_reason"] == "total_timesteps" and summary["servers_joined"] >= 1


# An env server that answers gRPC (health, Handshake, Reset) but refuses every step, as one whose step
# socket was full did: a fault-tolerant learner loses it at each step and finds it back at once.
_REFUSING_SERVER = """
import sys
from env_server.tuning import prefer_fast_grpc_core
prefer_fast_grpc_core()
import grpc
from env_server import service
def refuse(self, request):
    raise service.ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "every step refused (a fault the test injects)")
service.EnvService._step_actions = refuse
from env_server.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def refusing_server() -> Iterator[str]:
    argv = ["--env", "CartPole-v1", "--num-envs", "2", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _REFUSING_SERVER, *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("listening on "), line
    yield line.removeprefix("listening on ")
    proc.kill()
    proc.wait(timeout=10)


def test_a_server_that_fails_every_step_ends_the_run_with_nothing_to_learn(
    refusing_server: str, tmp_path: Path
) -> None:
    """Lost at every step and back at once, the server never stays down (--give-up-after never comes):
    rollouts that end with every server lost before any transition count as empty, and 3 in a row stop
    the run, rather than a loop without end that never learns (or, with a small budget, a run "done")."""
    args = Args(
        env="CartPole-v1",
        servers=refusing_server,
        fault_tolerant=True,
        num_steps=8,
        total_timesteps=4_000,
        **QUIET,
    )
    message = r"^no env gave a transition in 3 rollouts in a row: nothing to learn from, the run stops; every env's"
    with pytest.raises(NothingToLearnError, match=message):
        train(dataclasses.replace(args, run_dir=str(tmp_path / "run")))
    summary = rundir.read_json(tmp_path / "run" / rundir.SUMMARY)
    assert summary["stop_reason"].startswith("error: NothingToLearnError: ") and summary["updates"] == 0
    assert summary["failures"] >= 3
    # A budget of fewer rollouts than that: an error too, not a run done at --total-timesteps.
    with pytest.raises(NothingToLearnError, match=r"^no env gave a transition in (the run's rollout|2 rollouts in a)"):
        train(dataclasses.replace(args, total_timesteps=4, run_dir=str(tmp_path / "short")))


def test_a_run_that_starts_without_a_server_says_so_in_its_first_line(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault-tolerant start that went on without a listed server (down) names it in the line saying what
    the run trains on, not only in the warning before it."""
    caplog.set_level("INFO", logger="learner")
    a = serve(num_envs=2)[1]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{free.getsockname()[1]}"
    args = Args(env="CartPole-v1", servers=f"{a},{down}", connect_timeout=1.0, num_steps=8, total_timesteps=16)
    train(dataclasses.replace(args, run_dir=str(tmp_path / "run"), **QUIET))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PPO (classic preset")]
    assert f"on env servers at {a},{down}, 2 envs (without {down}: not joined yet), device" in line, line


def test_a_fleet_on_running_servers_is_described_by_the_addresses_as_read() -> None:
    """(The start line's and config.json's text: test below.)"""
    from learner.envs import FleetSpec

    assert FleetSpec("CartPole-v1", servers="a:1,, b:2, ").describe() == "env servers at a:1,b:2"
    assert FleetSpec("CartPole-v1", servers="compose:env").describe() == "env servers at compose:env"


@pytest.mark.slow
def test_the_line_saying_what_the_run_trains_on_lists_the_servers_as_read(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--servers "A,, B," (blanks, a trailing comma: ignored when connecting) was echoed as typed, in the
    start line and config.json's envs.description; they list the addresses as read."""
    caplog.set_level("INFO", logger="learner")
    a, b = serve(num_envs=1)[1], serve(num_envs=1)[1]
    args = Args(env="CartPole-v1", servers=f"{a},, {b},", num_steps=8, total_timesteps=16)
    train(dataclasses.replace(args, run_dir=str(tmp_path / "run"), **QUIET))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PPO (classic preset")]
    assert f"on env servers at {a},{b}, 2 envs, device" in line, line
    assert rundir.read_json(tmp_path / "run" / rundir.CONFIG)["envs"]["description"] == f"env servers at {a},{b}"


def test_config_json_keeps_the_versions_of_servers_that_join_later(serve: Serve, tmp_path: Path) -> None:
    a, b = serve(num_envs=2)[1], serve(num_envs=2)[1]
    servers = scheduled("versions-join", lambda k: [a] if k < 3 else [a, b])
    run = tmp_path / "run"
    train(Args(env="CartPole-v1", servers=servers, num_steps=8, total_timesteps=16 * 4, run_dir=str(run), **QUIET))
    versions = rundir.read_json(run / rundir.CONFIG)["server_versions"]
    assert sorted(versions) == sorted([a, b]) and versions[b]["gymnasium"] == versions[a]["gymnasium"]
