"""``learner eval`` and ``learner demo`` on the envs a run did not record, env errors in eval's own
terms, its threads, progress bar and Ctrl-C, channel-last images end to end, and ``learner plot`` of
runs of different envs; eval on servers without autoreset, --stochastic with --video, a Ctrl-C or an
error around the video, --seed's range, a Ctrl-C during a step that then fails, --json's object on any
error, and returns that overflow in process."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar
from unittest import mock

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import LocalServers, rundir
from learner.checkpoint import save_checkpoint
from learner.cli import main
from learner.config import PRESETS, Args
from learner.evaluate import _warn_other_task, evaluate
from learner.ppo import Agent
from tests.conftest import QUIET_FLAGS as QUIET
from tests.conftest import StartServers
from tests.envs import ClockEnv

# The env of the runs on running servers, named again to make it here (learner.config.check_served_env_here).
CLOCK = ["--env", "tests.envs:ClockEnv"]


class ChannelLastEnv(gym.Env[np.ndarray, np.int64]):
    """uint8 frames (size, size, 3), channel-last as cameras give them, or (``gray``) (size, size) with the
    lit channel as the frame's brightness; reward 1 for the action naming the lit channel."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(self, length: int = 4, size: int = 40, gray: bool = False) -> None:
        self.length, self.size, self.gray = length, size, gray
        self.observation_space = gym.spaces.Box(0, 255, (size, size) if gray else (size, size, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self._t = self._lit = 0

    def _obs(self) -> np.ndarray:
        if self.gray:
            return np.full((self.size, self.size), 80 * (self._lit + 1), np.uint8)
        obs = np.zeros((self.size, self.size, 3), np.uint8)
        obs[..., self._lit] = 200
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t, self._lit = 0, int(self.np_random.integers(3))
        return self._obs(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        reward = float(int(action) == self._lit)
        self._t, self._lit = self._t + 1, int(self.np_random.integers(3))
        return self._obs(), reward, False, self._t >= self.length, {}


class SignalledClockEnv(ClockEnv):
    """ClockEnv whose process gets signal ``signum`` at the env's ``signal_at``-th step (once per process),
    as a learner eval gets a Ctrl-C (SIGINT) or a SIGTERM."""

    sent: ClassVar[bool] = False

    def __init__(self, signal_at: int = 0, signum: int = signal.SIGINT, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signal_at, self.signum = signal_at, signum
        self._steps = 0

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self._steps == self.signal_at and not SignalledClockEnv.sent:
            SignalledClockEnv.sent = True
            os.kill(os.getpid(), self.signum)
        return super().step(action)


class LargeRewardClockEnv(ClockEnv):
    """ClockEnv whose rewards are ``scale`` times its own: at 1e308, finite rewards whose sum, an episode's
    return, is not (infinite; their spread NaN)."""

    def __init__(self, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = scale

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, abs(reward) * self.scale, terminated, truncated, info


class CrashingClockEnv(ClockEnv):
    """ClockEnv whose ``raise_at``-th step (over its life) raises: in the env made to render (``--video``'s)
    when ``rendered``, else in the others (the episodes')."""

    def __init__(self, raise_at: int = -1, rendered: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raise_at = raise_at if (self.render_mode == "rgb_array") == rendered else -1
        self._steps = 0

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self._steps == self.raise_at:
            raise RuntimeError(f"step {self._steps} failed on purpose")
        return super().step(action)


CLOCK_SPACES = (gym.spaces.Box(0.0, 1.0, (2,), np.float32), gym.spaces.Discrete(2))
"""ClockEnv's observation and action spaces (Discrete actions), as a checkpoint of it records them."""


def _train(run: Path, *argv: str) -> None:
    steps = ["--num-steps", "8", "--total-timesteps", "32"]
    assert main(["train", *argv, *steps, "--run-dir", str(run), *QUIET]) == 0


@pytest.fixture(scope="module")
def server_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained on a running server of ClockEnv(length=5): its options have no env kwargs, what the
    server said it makes its envs with is recorded (config.json's envs, the checkpoints' "served")."""
    run = tmp_path_factory.mktemp("runs") / "on-servers"
    with LocalServers("tests.envs:ClockEnv", 1, 2, env_kwargs={"length": 5}) as servers:
        _train(run, "--servers", servers.addresses[0])
    config = rundir.read_json(run / rundir.CONFIG)
    assert config["args"]["env_kwargs"] == {} and config["envs"]["env_kwargs"] == {"length": 5}
    return run


def _without_served_kwargs(run: Path, tmp_path: Path) -> Path:
    """The run's last checkpoint as a version before EnvSpec.env_kwargs wrote it (servers' kwargs unknown)."""
    old = tmp_path / "old.pt"
    state = torch.load(rundir.list_checkpoints(run)[-1], weights_only=True)
    del state["served"]["env_kwargs"]
    torch.save(state, old)
    return old


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "faulty"
    _train(run, "--env", "tests.envs:FaultyEnv", "--backend", "gym", "--num-envs", "2")
    return run


@pytest.fixture(scope="module")
def clock_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "clock"
    _train(run, "--env", "tests.test_eval:SignalledClockEnv", "--backend", "gym", "--num-envs", "2")
    return run


def _eval(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_eval_makes_a_run_on_running_servers_envs_with_the_kwargs_they_said(
    server_run: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="learner.evaluate")
    assert _eval(capsys, str(server_run), *CLOCK, "--episodes", "2", "--backend", "gym")["length_mean"] == 5.0
    assert _eval(capsys, str(server_run), *CLOCK, "--episodes", "1", "--num-envs", "1")["length_mean"] == 5.0
    argv = [str(server_run), *CLOCK, "--episodes", "1", "--env-kwargs", '{"length": 4}']
    assert _eval(capsys, *argv)["length_mean"] == 4.0
    assert not caplog.records


def test_a_module_env_that_running_servers_named_is_made_here_only_when_named_again(
    server_run: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's env, tests.envs:ClockEnv, is what its servers said they serve (train got no --env): made
    here (a local server, --backend gym, --video, a run moved off its servers) it would import a module a
    server named. Refused, naming the name and the option that confirms it; a gymnasium id imports nothing."""
    refusal = (
        "makes the run's env here, tests.envs:ClockEnv, which imports the module tests.envs: that name is what the "
        "servers the run trained on ("
    )
    confirm = "envfleet imports no name that came over the wire; give --env tests.envs:ClockEnv to build it here"
    addresses = start_servers("tests.envs:ClockEnv", 1, 2, env_kwargs={"length": 5})
    gif = str(server_run / "clock.gif")
    for argv, what in (
        ([], "eval"),
        (["--backend", "gym"], "eval"),
        (["--servers", addresses[0], "--video", gif], "--video"),
    ):
        capsys.readouterr()
        assert main(["eval", str(server_run), "--episodes", "1", *argv]) == 1
        err = capsys.readouterr().err
        assert f"{what}: {refusal}" in err and confirm in err, err
    assert main(["eval", str(server_run), "--episodes", "1", "--env", "tests.envs:FaultyEnv"]) == 1
    assert "env: expected the env the run in " in capsys.readouterr().err
    # On the servers, nothing is made here; named again, it is.
    assert _eval(capsys, str(server_run), "--episodes", "1", "--servers", addresses[0])["length_mean"] == 5.0
    assert _eval(capsys, str(server_run), *CLOCK, "--episodes", "1", "--backend", "gym")["length_mean"] == 5.0

    # A run moved off its servers onto envs train starts: the same.
    for flag in ("--resume", "--like"):
        with pytest.raises(SystemExit):
            main(["train", flag, str(server_run), "--num-servers", "1", "--total-timesteps", "64", *QUIET])
        err = capsys.readouterr().err
        assert f"{flag} with --num-servers: {refusal}" in err and confirm in err, err


def test_a_gymnasium_id_that_running_servers_named_is_made_here_without_asking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "cartpole"
    with LocalServers("CartPole-v1", 1, 2) as servers:
        _train(run, "--servers", servers.addresses[0])
    assert _eval(capsys, str(run), "--episodes", "1", "--backend", "gym")["episodes"] == 1


def test_eval_warns_that_a_run_on_running_servers_did_not_record_their_env_kwargs_and_takes_them_as_options(
    server_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of a version before the servers said their env kwargs."""
    caplog.set_level(logging.WARNING, logger="learner.evaluate")
    old = str(_without_served_kwargs(server_run, tmp_path))
    # The run's own options (none): ClockEnv's default length, not the servers' 5; said once.
    result = _eval(capsys, old, *CLOCK, "--episodes", "2", "--backend", "gym")
    assert result["length_mean"] == 3.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("the run trained on running env servers (")
    assert warnings[0].endswith(
        "whose env kwargs it does not record; the envs made here get env kwargs {}: if those servers were started "
        "with other kwargs, pass them as --env-kwargs (or evaluate on such servers with --servers)"
    )

    # --env-kwargs: the servers' task, on a local server too, and nothing left unknown: no warning. (Wrappers
    # need none: envs without the servers' have other spaces, which the checkpoint records; see below.)
    caplog.clear()
    result = _eval(capsys, old, *CLOCK, "--episodes", "2", "--env-kwargs", '{"length": 5}', "--num-envs", "2")
    assert result["length_mean"] == 5.0
    assert not caplog.records
    argv = [*CLOCK, "--episodes", "1", "--backend", "gym", "--env-kwargs", '{"length": 5}', "--wrappers", ""]
    assert _eval(capsys, old, *argv)["length_mean"] == 5.0
    assert not caplog.records


def test_eval_of_a_run_on_servers_with_wrappers_makes_its_envs_with_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The servers' wrappers and time limit are recorded (config.json's envs, the checkpoints' "served"):
    eval's envs get them. Checkpoints from before that name none: a hint to pass the servers' wrappers."""
    # clip-action serves Box actions unbounded: a policy trained behind it meets other spaces without it.
    run = tmp_path / "clipped"
    box = {"length": 3, "action": "box"}
    with LocalServers(
        "tests.envs:ClockEnv",
        1,
        2,
        env_kwargs=box,
        server_args=["--wrappers", "clip-action", "--max-episode-steps", "2"],
    ) as servers:
        _train(run, "--servers", servers.addresses[0])
    config = rundir.read_json(run / rundir.CONFIG)["envs"]
    assert (config["wrappers"], config["max_episode_steps"]) == (["clip-action"], 2)
    argv = ["eval", str(run), *CLOCK, "--episodes", "1", "--backend", "gym", "--env-kwargs", json.dumps(box)]
    assert _eval(capsys, *argv[1:])["length_mean"] == 2.0  # (clip-action, and the servers' time limit)
    assert main([*argv, "--wrappers", "none"]) == 1  # (explicitly without: the spaces say no, no hint)
    assert "but these envs (tests.envs:ClockEnv) have" in capsys.readouterr().err

    old = tmp_path / "old.pt"  # a checkpoint of a version that did not record them
    state = torch.load(rundir.list_checkpoints(run)[-1], weights_only=True)
    del state["served"]
    torch.save(state, old)
    argv[1] = str(old)
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "and actions Box(-inf, inf, (1,), float32), but these envs (tests.envs:ClockEnv) have" in err, err
    assert err.rstrip().endswith(
        f"the run trained on running env servers ({servers.addresses[0]}), whose wrappers and env kwargs it does not "
        "record, and these envs got wrappers none: pass those servers' as --wrappers (and --env-kwargs)"
    ), err
    caplog.clear()
    assert _eval(capsys, *argv[1:], "--wrappers", "clip-action")["length_mean"] == 3.0
    assert not caplog.records


def test_eval_env_kwargs_replace_the_runs_and_reach_the_video(
    faulty_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    result = _eval(capsys, str(faulty_run), "--episodes", "2", "--backend", "gym", "--env-kwargs", '{"length": 7}')
    assert result["length_mean"] == 7.0 and not caplog.records  # (a run on envs it started: nothing unknown)


# (numpy's warnings of the returns that overflow, on purpose)
@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_eval_json_is_valid_json_with_returns_too_large_for_a_float(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json's object is JSON any parser reads: returns near float64's max, whose sum or squares overflow, have
    a finite mean and spread; a return that is no finite number (finite rewards whose sum overflows) is an error
    naming the env, as a NaN reward is (not a result of Python's bare Infinity or NaN, nor of nulls)."""
    run = tmp_path / "run"
    _train(run, "--env", "tests.test_eval:LargeRewardClockEnv", "--backend", "gym", "--num-envs", "2")
    capsys.readouterr()
    argv = ["eval", str(run), "--episodes", "2", "--backend", "gym", "--env-kwargs", '{"scale": 1e308}', "--json"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["episodes"] == 0, captured.out  # (the error's object: no episode finished)
    assert "is inf for the episode that ended: its rewards, finite each, summed beyond" in captured.err, captured.err
    argv[argv.index('{"scale": 1e308}')] = '{"scale": 5e307}'  # (3 steps: a return of up to 1.5e308)
    assert main(argv) == 0
    out = capsys.readouterr().out

    def refuse(token: str) -> Any:
        raise AssertionError(f"not JSON: {token} in {out}")

    result = json.loads(out, parse_constant=refuse)
    assert result["episodes"] == 2 and result["returns"][0] == result["returns"][1]
    assert result["return_mean"] == pytest.approx(result["returns"][0]) and result["return_std"] == 0.0
    assert result["length_mean"] == 3.0


def test_eval_video_env_gets_the_given_env_kwargs(
    server_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gif = tmp_path / "clock.gif"
    argv = [str(server_run), *CLOCK, "--episodes", "1", "--backend", "gym", "--video", str(gif)]
    assert _eval(capsys, *argv, "--env-kwargs", '{"length": 5}', "--wrappers", "")["video"]["steps"] == 5


def test_eval_with_running_servers_refuses_env_options_they_decide(
    server_run: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    for flag, value in (("--env-kwargs", '{"length": 5}'), ("--wrappers", "atari"), ("--max-episode-steps", "9")):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", str(server_run), "--servers", "127.0.0.1:1", flag, value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"learner eval: error: {flag}: configures the envs eval makes (a local server, --backend gym," in err
        assert "with --servers the running servers decide" in err
    with pytest.raises(SystemExit):
        main(["eval", str(server_run), "--env-kwargs", "[1]"])
    assert (
        "argument --env-kwargs: expected a JSON object like '{\"key\": 1}', got list: '[1]'" in capsys.readouterr().err
    )
    # On running servers, their own options: no warning about the run's.
    caplog.set_level(logging.WARNING, logger="learner.evaluate")
    addresses = start_servers("tests.envs:ClockEnv", 1, 2, env_kwargs={"length": 5})
    assert _eval(capsys, str(server_run), "--episodes", "2", "--servers", addresses[0])["length_mean"] == 5.0
    assert not caplog.records
    # Servers of the same env and spaces whose envs are made otherwise: another task, evaluated with a warning.
    other = start_servers("tests.envs:ClockEnv", 1, 2, env_kwargs={"length": 4})
    assert _eval(capsys, str(server_run), "--episodes", "1", "--servers", other[0])["length_mean"] == 4.0
    assert [r.getMessage() for r in caplog.records] == [
        f"--servers: the servers at {other[0]} make their envs otherwise than the envs the run trained on: env kwargs "
        '{"length": 4} (the run\'s: {"length": 5}); the returns are of that task, not the one the policy learned '
        "(evaluate on servers started as the run's, or leave --servers out: eval makes envs as the run's)"
    ]


@pytest.mark.parametrize("backend", ["remote", "gym"])
def test_eval_stops_at_an_env_error_in_its_own_terms(
    faulty_run: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    argv = ["eval", str(faulty_run), "--episodes", "2", "--num-envs", "2", "--backend", backend]
    assert main([*argv, "--env-kwargs", '{"raise_at": 3, "fault_env": -1}']) == 1
    err = capsys.readouterr().err
    # (in process, too: an episode cut short by an env's exception is never counted as one)
    assert "raised in step: ValueError: step 3 failed on purpose" in err, err
    assert "eval stops at an env's error, as an episode cut short is no sample" in err
    assert "fault_tolerant" not in err and "infos[" not in err and "Traceback" not in err.split("learner eval:")[-1]
    assert main([*argv, "--env-kwargs", '{"raise_in_reset": 0, "fault_env": -1}']) == 1
    assert "raised in reset: RuntimeError: reset failed on purpose" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_timeout_names_the_option(faulty_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    argv = ["eval", str(faulty_run), "--episodes", "1", "--num-envs", "1", "--timeout", "0.5"]
    assert main([*argv, "--env-kwargs", '{"hang_at": 2, "hang_s": 2, "fault_env": -1}']) == 1
    err = capsys.readouterr().err
    assert "failed [DEADLINE_EXCEEDED]: no answer within the 0.5 s deadline" in err, err
    assert "raise --timeout if the env is slow" in err and "`timeout`" not in err


def test_eval_of_an_mlp_on_the_cpu_takes_one_torch_thread_as_train_does(
    clock_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second OpenMP thread only contends with the envs for the cores (eval ran 4-8x slower with it);
    afterwards the process has its own setting back (evaluate() is a library function too)."""
    threads = torch.get_num_threads()
    during: list[int] = []
    real_act = Agent.act

    def act(self: Agent, *args: Any, **kwargs: Any) -> Any:
        during.append(torch.get_num_threads())
        return real_act(self, *args, **kwargs)

    monkeypatch.setattr(Agent, "act", act)
    try:
        torch.set_num_threads(2)
        assert _eval(capsys, str(clock_run), "--episodes", "2", "--backend", "gym", "--device", "cpu")["episodes"] == 2
        assert during and set(during) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_eval_shows_a_progress_bar_of_its_episodes_when_asked_and_none_otherwise(
    clock_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", str(clock_run), "--episodes", "6", "--backend", "gym", "--num-envs", "2"]
    capsys.readouterr()
    assert main([*argv, "--progress"]) == 0
    err = capsys.readouterr().err
    assert "6/6 episodes" in err and "return 2 +- 0]" in err, err  # (the policy gets 2 of ClockEnv's 3)
    assert main(argv) == 0  # (stderr is no terminal here: no bar)
    assert "episodes [" not in capsys.readouterr().err


def _sigterm_unhandled(signum: int, frame: object) -> None:
    raise AssertionError("SIGTERM reached the test's own handler: eval did not handle it")


@pytest.fixture
def sigterm_caught() -> Iterator[None]:
    """SIGTERM, unless eval handles it, fails the test rather than killing pytest."""
    previous = signal.signal(signal.SIGTERM, _sigterm_unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.usefixtures("sigterm_caught")
def test_eval_stopped_by_ctrl_c_or_sigterm_reports_the_episodes_finished(
    clock_run: Path, signum: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The signal comes at an env's 10th step (of its own: autoresets are none), when 3 of its 3-step
    episodes have ended, and as many of the other env's: the step under way ends, and the result is
    theirs (exit status 130)."""
    argv = ["eval", str(clock_run), "--episodes", "100", "--backend", "gym", "--num-envs", "2"]
    kwargs = ["--env-kwargs", json.dumps({"signal_at": 10, "signum": int(signum)})]
    capsys.readouterr()
    SignalledClockEnv.sent = False
    assert main([*argv, *kwargs]) == 130
    out = capsys.readouterr().out
    assert ": interrupted: 6 episodes of 100 finished of the deterministic policy in " in out, out
    assert "return 2 +- 0 (min 2, max 2), mean length 3.0" in out, out
    SignalledClockEnv.sent = False
    assert main([*argv, *kwargs, "--json"]) == 130
    result = json.loads(capsys.readouterr().out)
    assert result["interrupted"] and (result["episodes"], result["episodes_asked"]) == (6, 100)
    assert result["returns"] == [2.0] * 6 and result["return_std"] == 0.0
    # A stop before any episode ended: the count, and no statistics.
    SignalledClockEnv.sent = False
    assert main([*argv, "--env-kwargs", json.dumps({"signal_at": 1, "signum": int(signum)}), "--json"]) == 130
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 0 and result["return_mean"] is None


def test_demo_builds_its_envs_with_env_kwargs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--env", "tests.envs:ClockEnv", "--env-kwargs", '{"length": 5}', "--steps", "20"]
    assert main([*argv, "--num-servers", "2", "--envs-per-server", "1"]) == 0
    out = capsys.readouterr().out
    # After the reset and a warm-up step, 5-step episodes (6 vector steps with next-step autoreset)
    # end at steps 4, 10 and 16 of the 20 timed ones, on each of the 2 envs (3-step ones would end 10 times).
    assert "6 episodes ended on the remote envs" in out, out


@pytest.mark.parametrize(("load", "busy"), [(0.0, False), (10_000.0, True)])
def test_demo_says_when_the_machine_was_busy(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, load: float, busy: bool
) -> None:
    """Its ratio is one measurement on whatever else the machine runs: a load average at least the
    CPUs' count as it starts says the figures are not to be trusted, as learner bench does."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert main(["demo", "--env", "tests.envs:ClockEnv", "--steps", "10", "--num-servers", "1"]) == 0
    out = capsys.readouterr().out
    assert ("Warning: the machine was busy: 1-minute load average 10000.0 at the start" in out) is busy, out
    assert ("Run it again on an idle machine" in out) is busy


@pytest.mark.parametrize(
    ("load", "threads", "warned"), [(10_000.0, [], True), (0.0, [], False), (10_000.0, ["1"], False)]
)
def test_a_cnn_on_a_busy_machine_suggests_one_torch_thread(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    load: float,
    threads: list[str],
    warned: bool,
) -> None:
    """Runs side by side (seeds) each take every core for a CNN's updates: 3 Pong runs on 2 cores went
    2.1-2.4x faster with --torch-threads 1. Said when the machine is busy as the run starts."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    option = ["--torch-threads", *threads] if threads else []
    with caplog.at_level("WARNING", logger="learner.train"):
        _train(
            tmp_path / "r",
            "--env",
            "tests.test_eval:ChannelLastEnv",
            "--backend",
            "gym",
            "--num-envs",
            "2",
            "--device",  # (the advice is for CPU threads: a CNN on CUDA updates on the GPU)
            "cpu",
            *option,
        )
    said = [r.getMessage() for r in caplog.records if "--torch-threads 1 each" in r.getMessage()]
    assert len(said) == warned, said
    if said:
        assert said[0].startswith("this machine is busy (1-minute load average 10000.0 on ")


@pytest.mark.parametrize(("gray", "shape"), [(False, "(40, 40, 3)"), (True, "(40, 40)")])
def test_channel_last_and_grayscale_images_train_with_the_nature_cnn_and_evaluate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], gray: bool, shape: str
) -> None:
    run = tmp_path / "camera"
    capsys.readouterr()
    kwargs = ["--env-kwargs", json.dumps({"gray": gray})]
    _train(run, "--env", "tests.test_eval:ChannelLastEnv", *kwargs, "--backend", "gym", "--num-envs", "2")
    assert "PPO (atari preset, Nature CNN) on tests.test_eval:ChannelLastEnv" in capsys.readouterr().out
    config = rundir.read_json(run / rundir.CONFIG)
    assert config["envs"]["observation_space"] == f"Box(0, 255, {shape}, uint8)"
    result = _eval(capsys, str(run), "--episodes", "2", "--backend", "gym")
    assert result["episodes"] == 2 and result["length_mean"] == 4.0


def test_dict_observations_train_through_local_servers_with_a_cnn_per_image_key_and_evaluate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A robot's camera frame (uint8, channel-last), state vector and a Discrete phase, served as a Dict: no
    # --wrappers flatten, the frames stay bytes on the wire and in the rollout.
    run = tmp_path / "dict"
    capsys.readouterr()
    kwargs = ["--env-kwargs", json.dumps({"length": 4})]
    _train(run, "--env", "tests.envs:CameraClockEnv", *kwargs, "--num-servers", "2", "--envs-per-server", "1")
    said = capsys.readouterr().out
    assert "PPO (classic preset, Dict: Nature CNN per image key, MLP 64,64) on tests.envs:CameraClockEnv" in said
    config = rundir.read_json(run / rundir.CONFIG)
    assert config["envs"]["observation_space"].startswith("Dict('image': Box(0, 255, (36, 36, 1), uint8)")
    # Evaluated on env servers (the run's) and in process alike.
    for backend in (["--backend", "gym"], []):
        result = _eval(capsys, str(run), "--episodes", "2", *backend)
        assert result["episodes"] == 2 and result["length_mean"] == 4.0
    # With --norm-obs the checkpoint holds the state vector's statistics, which eval normalises it with.
    normed = tmp_path / "normed"
    _train(normed, "--env", "tests.envs:CameraClockEnv", *kwargs, "--backend", "gym", "--num-envs", "2", "--norm-obs")
    assert _eval(capsys, str(normed), "--episodes", "2", "--backend", "gym")["length_mean"] == 4.0


def test_train_refuses_images_too_small_for_the_cnn_rather_than_an_mlp_on_raw_pixels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    env = ["--env", "tests.test_eval:ChannelLastEnv", "--env-kwargs", '{"size": 32}', "--backend", "gym"]
    assert main(["train", *env, "--run-dir", str(tmp_path / "r"), *QUIET]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "learner train: error: observation_space: uint8 images of shape (32, 32, 3) do not fit the Nature CNN, "
        "which takes (C, H, W), or (H, W, C) with C from 1 to 4, with H and W >= 36; resize or transpose them on "
        "the env server (for ALE ids: --wrappers atari, 4x84x84)"
    ), err
    assert "Traceback" not in err


def test_train_refuses_images_whose_cnn_would_be_huge_before_building_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A camera's frames, 1080x1920, gave the Nature CNN a billion parameters: minutes of silence building it
    (and 16 GB with Adam's moments) before the first step. Frames of 800x800 (302 million) are refused at once,
    before the run dir, saying how to make them smaller."""
    capsys.readouterr()
    env = ["--env", "tests.test_eval:ChannelLastEnv", "--env-kwargs", '{"size": 800}', "--backend", "gym"]
    assert main(["train", *env, "--num-envs", "1", "--run-dir", str(tmp_path / "r"), *QUIET]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "learner train: error: observation_space: uint8 images of shape (800, 800, 3) would give the Nature CNN "
        "302,066,336 parameters (1.2 GB of float32 weights, 4.8 GB with their gradients and Adam's moments), over "
        "the 268,435,456 it is built with"
    ), err
    assert "ResizeObservation" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_train_resumes_a_run_whose_cnn_is_over_the_limit_and_refuses_one_like_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose Nature CNN is over the limit (trained before it, as an 800x800 camera's on a GPU could be)
    already has the network: --resume continues it, as eval evaluates it (was: refused, 'Make the frames
    smaller', which its checkpoint's envs cannot be). --like starts a new network: refused, no run dir made.
    (The limit lowered below the 109,216 parameters of (40, 40, 3) frames stands for such a run.)"""
    run = tmp_path / "camera"
    env = ["--env", "tests.test_eval:ChannelLastEnv", "--backend", "gym", "--num-envs", "2"]
    _train(run, *env)
    monkeypatch.setattr("learner.ppo.MAX_CNN_PARAMETERS", 100_000)
    capsys.readouterr()
    like = tmp_path / "like"
    assert main(["train", "--like", str(run), "--run-dir", str(like), *QUIET]) == 1
    err = capsys.readouterr().err
    assert "would give the Nature CNN 109,216 parameters" in err and "Traceback" not in err, err
    assert not like.exists()
    assert main(["train", "--resume", str(run), "--num-steps", "8", "--total-timesteps", "64", *QUIET]) == 0, (
        capsys.readouterr().err
    )
    assert rundir.read_json(run / "summary.json")["total_steps"] == 64


def _checkpoint(run: Path, args: Args, obs_space: gym.Space[Any], action_space: gym.Space[Any]) -> Path:
    """A checkpoint of an untrained policy, as train writes one (what eval reads of it)."""
    hp = PRESETS["atari"]
    agent = Agent(obs_space, action_space)
    payload = {
        "args": args.to_json(),
        "ppo": {"hidden_sizes": list(hp["hidden_sizes"]), "action_bounds": hp["action_bounds"]},
        "observation_space": str(obs_space),
        "action_space": str(action_space),
        "model": agent.state_dict(),
        "obs_rms": None,
    }
    return save_checkpoint(run, 8, payload)


def test_a_checkpoint_whose_nets_do_not_fit_the_policy_built_now_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Grayscale frames got an MLP before 8e003e0, the Nature CNN since: such a checkpoint is refused
    saying so, not with torch's RuntimeError."""
    frames = gym.spaces.Box(0, 255, (40, 40), np.uint8)
    path = _checkpoint(
        tmp_path, Args(env="tests.test_eval:ChannelLastEnv", backend="gym"), frames, gym.spaces.Discrete(3)
    )
    state = torch.load(path, weights_only=False)
    state["model"] = Agent(gym.spaces.Box(0.0, 255.0, (40, 40), np.float32), gym.spaces.Discrete(3)).state_dict()
    torch.save(state, path)
    capsys.readouterr()
    argv = ["eval", str(path), "--episodes", "1", "--backend", "gym", "--env-kwargs", '{"gray": true}']
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {path}: its nets do not fit the policy this envfleet builds for its spaces (" in err, err
    assert "Traceback" not in err


def test_eval_of_an_atari_policy_on_raw_frames_suggests_the_atari_wrapper(
    tmp_path: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ale_py")
    frames = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    _checkpoint(tmp_path, Args(env="ALE/Pong-v5", backend="gym"), frames, gym.spaces.Discrete(6))
    capsys.readouterr()
    argv = ["eval", str(tmp_path), "--episodes", "1", "--num-envs", "1"]
    assert main([*argv, "--backend", "gym", "--wrappers", ""]) == 1
    err = capsys.readouterr().err
    assert "but these envs (ALE/Pong-v5) have Box(0, 255, (210, 160, 3), uint8)" in err, err
    assert err.rstrip().endswith(
        "the policy saw the env server's atari wrapper's 4x84x84 frame stacks: pass --wrappers atari"
    )
    addresses = start_servers("ALE/Pong-v5", 1, 1)  # raw frames
    assert main(["eval", str(tmp_path), "--episodes", "1", "--servers", addresses[0]]) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith("these look like raw frames: start the servers with --wrappers atari"), err


def test_plot_of_runs_of_different_envs_says_whose_solved_line_is_whose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.figure

    runs = []
    for name, env, threshold in [("ip1", "InvertedPendulum-v5", 950.0), ("dict1", "tests.envs:DictEnv", None)]:
        run = tmp_path / name
        run.mkdir()
        rows = [
            {"update": i, "global_step": 16 * i, "seconds": 0.1 * i, "episodic_return_mean": 1.0 * i} for i in (1, 2)
        ]
        rundir.rewrite_jsonl(run / rundir.METRICS, rows)
        rundir.write_json(run / rundir.CONFIG, {"args": {"env": env}, "solved_threshold": threshold})
        runs.append(str(run))
    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *args, **kwargs: saved.append(fig))

    def texts() -> tuple[str, list[str]]:
        fig = saved.pop()
        return fig.get_suptitle(), [t.get_text() for t in fig.legends[0].get_texts()]

    assert main(["plot", *runs, "-o", str(tmp_path / "both.png")]) == 0
    title, labels = texts()
    assert title == "runs of different envs: InvertedPendulum-v5, tests.envs:DictEnv"
    assert labels == [
        "ip1 [InvertedPendulum-v5]",
        "dict1 [tests.envs:DictEnv]",
        "solved (InvertedPendulum-v5): mean return >= 950",
    ]
    # One env: as before, the env in the title (and its solved line still says whose it is).
    assert main(["plot", runs[0], "-o", str(tmp_path / "one.png")]) == 0
    assert texts() == ("InvertedPendulum-v5", ["ip1", "solved (InvertedPendulum-v5): mean return >= 950"])


@pytest.mark.slow
def test_an_episode_that_goes_on_without_a_time_limit_is_warned_of_and_a_limit_may_be_given(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """(Was: eval of CliffWalking, whose deterministic policy walks into a wall for ever, waited in silence;
    and a time limit could not be given.) ClockEnv, a class, has no registered time limit."""
    run = tmp_path / "clock"
    _train(run, "--env", "tests.envs:ClockEnv", "--env-kwargs", '{"length": 40}', "--backend", "gym", "--num-envs", "2")
    monkeypatch.setattr("learner.evaluate.LONG_EPISODE", 30)
    with caplog.at_level(logging.WARNING, logger="learner.evaluate"):
        result = evaluate(run, episodes=2, num_envs=2, backend="gym", progress=False)
    assert result["length_mean"] == 40
    said = [r.getMessage() for r in caplog.records if "no time limit" in r.getMessage()]
    assert said == [
        "env 0's episode has gone on for 30 steps, and these envs have no time limit: the policy may never end it "
        "(give --max-episode-steps N)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="learner.evaluate"):
        result = evaluate(run, episodes=2, num_envs=2, backend="gym", progress=False, max_episode_steps=35)
    assert result["length_mean"] == 35 and "no time limit" not in caplog.text  # (past LONG_EPISODE: limited)
    limited = _eval(
        capsys, str(run), "--episodes", "2", "--num-envs", "2", "--backend", "gym", "--max-episode-steps", "25"
    )
    assert limited["length_mean"] == 25


def test_eval_on_servers_warns_of_another_time_limit_or_none() -> None:
    for run_limit, limit, warned in ((100, 100, False), (100, 500, True), (100, None, True), (None, 100, True)):
        served: dict[str, Any] = {"env_kwargs": {}, "max_episode_steps": run_limit}
        envs = SimpleNamespace(env_kwargs={}, spec=SimpleNamespace(max_episode_steps=limit))
        with mock.patch("learner.evaluate.log") as log:
            _warn_other_task(served, envs, "s:1")
        assert log.warning.called is warned
        if warned:
            assert f"time limit {limit or 'none'} (the run's: {run_limit or 'none'})" in log.warning.call_args.args[2]
    # A server (or a run) too old to say its env kwargs, or a spec not read: nothing (or no time limit) to compare.
    served = {"env_kwargs": {}, "max_episode_steps": 100}
    for envs in (
        SimpleNamespace(env_kwargs=None, spec=SimpleNamespace(max_episode_steps=None)),
        SimpleNamespace(env_kwargs={}, spec=None),
    ):
        with mock.patch("learner.evaluate.log") as log:
            _warn_other_task(served, envs, "s:1")
        assert not log.warning.called
    with mock.patch("learner.evaluate.log") as log:
        _warn_other_task({"max_episode_steps": 100}, SimpleNamespace(env_kwargs={}, spec=None), "s:1")
    assert not log.warning.called


# -- the autoreset modes, --stochastic, --video and --seed --------------------------------------------------


def test_eval_on_servers_that_reset_no_env_by_themselves_resets_those_that_ended(
    tmp_path: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """env-server --autoreset-mode Disabled: an env that ended waits for a reset, which eval gives it (alone,
    the other's episode going on) while episodes are left, as a next-step autoreset would: the same episodes.
    (StaggeredClockEnv: env 0's last 3 steps, env 1's 4; 5 episodes, 2 of env 0 and 3 of env 1: 3.6 steps.)"""
    _checkpoint(tmp_path, Args(env="tests.envs:StaggeredClockEnv", backend="gym"), *CLOCK_SPACES)
    (disabled,) = start_servers("tests.envs:StaggeredClockEnv", 1, 2, server_args=["--autoreset-mode", "Disabled"])
    (next_step,) = start_servers("tests.envs:StaggeredClockEnv", 1, 2)
    for address in (disabled, next_step):
        result = _eval(capsys, str(tmp_path), "--episodes", "5", "--servers", address)
        assert (result["episodes"], result["length_mean"]) == (5, 3.6), result


def test_eval_stochastic_returns_are_the_same_with_or_without_a_video(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The episodes' samples come from torch's generator seeded right before them, whatever drew from it
    before (the policy's nets as they are built, the video's episode); the video's, seeded before it."""
    _checkpoint(tmp_path, Args(env="tests.envs:ClockEnv", backend="gym"), *CLOCK_SPACES)
    argv = [str(tmp_path), "--episodes", "4", "--backend", "gym", "--stochastic", "--env-kwargs", '{"length": 20}']
    plain = _eval(capsys, *argv)
    gif = str(tmp_path / "ep.gif")
    filmed = _eval(capsys, *argv, "--video", gif)
    assert filmed["returns"] == plain["returns"] and not filmed["deterministic"], (filmed, plain)
    assert _eval(capsys, *argv, "--video", gif)["video"]["return"] == filmed["video"]["return"]


def test_evaluate_refuses_servers_with_the_gym_backend(tmp_path: Path) -> None:
    """As ``learner eval --servers ... --backend gym`` is refused (the servers were ignored, silently)."""
    path = _checkpoint(tmp_path, Args(env="tests.envs:ClockEnv", backend="gym"), *CLOCK_SPACES)
    with pytest.raises(
        ValueError, match=r"^servers: evaluates on running env servers \(127\.0\.0\.1:1\), so it cannot go "
    ):
        evaluate(path, 1, servers="127.0.0.1:1", backend="gym", progress=False)


def test_eval_seed_beyond_64_bits_names_the_option_and_its_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Env i gets seed + i, a 64-bit seed: beyond, the usage error names --seed (it was torch's "Overflow
    when unpacking long long"); evaluate() names its argument."""
    path = _checkpoint(tmp_path, Args(env="tests.envs:ClockEnv", backend="gym"), *CLOCK_SPACES)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(path), "--seed", str(2**64), "--backend", "gym", "--episodes", "2"])
    assert exit_info.value.code == 2
    assert (
        "learner eval: error: --seed: expected an integer from 0 to 2**64 - 2 (18446744073709551614: env i gets "
        "seed + i, a 64-bit seed), got 18446744073709551616"
    ) in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^seed: expected an integer from 0 to 2\*\*64 - 1 "):
        evaluate(path, 1, backend="gym", seed=2**64, progress=False)
    assert _eval(capsys, str(path), "--episodes", "1", "--backend", "gym", "--seed", str(2**64 - 1))["episodes"] == 1


def test_eval_stopped_by_ctrl_c_during_the_video_writes_it_as_far_as_it_got_and_plays_no_episode(
    clock_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first Ctrl-C stops after the current step there too (it aborted at once): the video's frames so far
    (frame t of ClockEnv's is 50 t bright: 3 differ) are written and reported, cut short; no episode is played."""
    from PIL import Image

    gif = tmp_path / "ep.gif"
    argv = ["eval", str(clock_run), "--episodes", "4", "--backend", "gym", "--num-envs", "2", "--video", str(gif)]
    kwargs = ["--env-kwargs", json.dumps({"signal_at": 2, "length": 5})]
    capsys.readouterr()
    SignalledClockEnv.sent = False
    assert main([*argv, *kwargs, "--json"]) == 130
    result = json.loads(capsys.readouterr().out)
    assert result["interrupted"] and (result["episodes"], result["episodes_asked"]) == (0, 4), result
    assert (result["video"]["steps"], result["video"]["episode_ended"]) == (2, False), result
    with Image.open(gif) as image:
        assert getattr(image, "n_frames", 1) == 3
    SignalledClockEnv.sent = False
    assert main([*argv, *kwargs]) == 130
    out = capsys.readouterr().out
    assert ": interrupted: 0 episodes of 4 finished of the deterministic policy in " in out, out
    assert f"video: {gif} (one more episode, in process: 2 steps, cut there, return " in out, out


def test_eval_video_of_an_env_that_raised_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process, the env's exception ends its episode (truncated, infos["env_error"]): that is no episode
    to show as one (it was written as one), so no video, and eval stops as a video that cannot be made does."""
    _checkpoint(tmp_path, Args(env="tests.test_eval:CrashingClockEnv", backend="gym"), *CLOCK_SPACES)
    gif = tmp_path / "ep.gif"
    argv = ["eval", str(tmp_path), "--episodes", "1", "--backend", "gym", "--video", str(gif)]
    capsys.readouterr()
    assert main([*argv, "--env-kwargs", '{"raise_at": 2}']) == 1
    out, err = capsys.readouterr()
    assert not out and not gif.exists(), out
    assert err.rstrip().endswith(
        "learner eval: error: video: tests.test_eval:CrashingClockEnv raised in step: RuntimeError: step 2 failed on "
        "purpose (in this process); no video written, as its episode was cut short by the error"
    ), err


def test_eval_stopped_by_an_error_reports_the_video_written_before_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The video is written before the episodes: one stopped by an error before any ended still reports it
    (--json printed nothing)."""
    _checkpoint(tmp_path, Args(env="tests.test_eval:CrashingClockEnv", backend="gym"), *CLOCK_SPACES)
    gif = tmp_path / "ep.gif"
    argv = ["eval", str(tmp_path), "--episodes", "2", "--num-envs", "1", "--backend", "gym", "--video", str(gif)]
    argv += ["--env-kwargs", json.dumps({"raise_at": 2, "rendered": False})]
    capsys.readouterr()
    assert main([*argv, "--json"]) == 1
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert (result["episodes"], result["episodes_asked"], result["video"]["path"]) == (0, 2, str(gif)), result
    assert "raised in step: RuntimeError: step 2 failed on purpose" in result["error"] and gif.exists()
    assert err.rstrip().endswith(f"learner eval: error: {result['error']}"), (err, result["error"])
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "0 of 2 episodes finished before the error," in out, out
    assert f"video: {gif} (one more episode, in process: 3 steps, return " in out, out


# -- a stop during a step that then fails, --json on any error, returns that overflow in process -------------


@pytest.mark.slow
def test_eval_stopped_by_ctrl_c_during_a_step_that_then_passes_its_deadline_is_interrupted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The Ctrl-C came while the env's step hung: the step's deadline error that follows ended it as asked,
    no error (it was one, advising to raise --timeout, exit 1: a shell loop went on). ClockEnv's first
    3-step episode has ended by the 5th step of its env, which sends it."""
    _checkpoint(tmp_path, Args(env="tests.eval_envs:StopThenHangEnv", backend="gym"), *CLOCK_SPACES)
    kwargs = {"signal_pid": os.getpid(), "signal_at": 5, "hang_s": 9.0}
    argv = ["eval", str(tmp_path), "--episodes", "4", "--num-envs", "1", "--timeout", "3", "--json"]
    capsys.readouterr()
    assert main([*argv, "--env-kwargs", json.dumps(kwargs)]) == 130
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["interrupted"] and (result["episodes"], result["episodes_asked"]) == (1, 4), result
    assert "error" not in result
    assert "learner eval: error" not in err, err
    said = caplog.text
    assert "the step under way when the stop was asked failed: env server " in said, said
    assert "no answer within the 3 s deadline" in said and "timeout" not in said.split("3 s deadline")[1], said


def test_eval_json_prints_an_object_with_the_error_whatever_stopped_it(
    faulty_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script reads --json's stdout: an error before any episode ended (an env's in its first reset, a
    damaged checkpoint, a video that cannot be made) printed nothing there. The exit status is 1 as before."""
    argv = ["eval", str(faulty_run), "--episodes", "2", "--backend", "gym", "--json"]
    capsys.readouterr()
    assert main([*argv, "--env-kwargs", '{"raise_in_reset": 0, "fault_env": -1}']) == 1
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert (result["episodes"], result["episodes_asked"], result["return_mean"]) == (0, 2, None), result
    assert "raised in reset: RuntimeError: reset failed on purpose" in result["error"]
    assert err.rstrip().endswith(f"learner eval: error: {result['error']}"), err
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(b"hello\n")
    assert main(["eval", str(damaged), "--backend", "gym", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "error": f"{damaged}: expected an envfleet checkpoint, but it is not a checkpoint torch "
        "can read (torch.save writes a zip archive; this file starts b'hello\\n')",
        "exit_status": 1,
    }, out
    _checkpoint(tmp_path, Args(env="tests.test_eval:CrashingClockEnv", backend="gym"), *CLOCK_SPACES)
    video = ["--backend", "gym", "--video", str(tmp_path / "ep.gif"), "--env-kwargs", '{"raise_at": 2}', "--json"]
    assert main(["eval", str(tmp_path), *video]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"].startswith("video: tests.test_eval:CrashingClockEnv raised in step: "), out


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_eval_of_returns_that_overflow_in_process_says_so_in_its_terms_without_numpy_s_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rewards of 1e308 each, whose sum overflows: the error says so, and numpy's "overflow encountered in
    add" came before it; in process, no env server is there to wrap the env (its advice said so)."""
    _checkpoint(tmp_path, Args(env="tests.test_eval:LargeRewardClockEnv", backend="gym"), *CLOCK_SPACES)
    argv = ["eval", str(tmp_path), "--episodes", "1", "--backend", "gym", "--env-kwargs", '{"scale": 1e308}']
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "is inf for the episode that ended: its rewards, finite each, summed beyond float64's range" in err, err
    assert err.rstrip().endswith("(scale the rewards in a wrapper of the env, which runs in this process)"), err


# -- --json on a usage error or an abort, a space changed by --env-kwargs -------------------------------------


def test_eval_json_prints_an_object_on_a_usage_error_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad option value, an unknown option, options that do not go together (exit status 2, argparse's):
    --json printed nothing on stdout there, where a script reads it. Now one object, with the error as
    stderr says it and the status; the usage stays on stderr. Without --json, stdout stays empty."""
    capsys.readouterr()
    for argv, error in (
        (["--episodes", "0"], "argument --episodes: expected an integer >= 1, got '0'"),
        (["run", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["run", "--video-fps", "10"], "--video-fps: sets the speed of the GIF that --video PATH.gif writes; give "),
    ):
        for json_flag in ("--json", "--js"):  # (argparse takes an abbreviation of it: so does the check)
            with pytest.raises(SystemExit) as exited:
                main(["eval", json_flag, *argv])
            assert exited.value.code == 2
            out, err = capsys.readouterr()
            result = json.loads(out)
            assert set(result) == {"error", "exit_status"} and result["exit_status"] == 2, result
            assert result["error"].startswith(error), result
            assert err.startswith("usage: learner eval ") and f"learner eval: error: {result['error']}\n" in err, err
        with pytest.raises(SystemExit):
            main(["eval", *argv])
        assert capsys.readouterr().out == ""


def test_eval_json_prints_an_object_on_a_usage_error_before_the_command_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error of the options before the command (learner --log-level bad eval --json ...), the
    top-level parser's, printed nothing on stdout, nor did --json given before eval; now the object too, as
    for eval's own options. Not where the command is another one, or no --json is eval's, nor for --help."""
    capsys.readouterr()
    for argv, error in (
        (["--log-level", "bad", "eval", "--json", "run"], "argument --log-level: invalid choice: 'bad' (choose "),
        (["--log-level=bad", "eval", "run", "--js"], "argument --log-level: invalid choice: 'bad' (choose "),
        (["--log", "bad", "eval", "--json"], "ambiguous option: --log could match --log-level, --log-format"),
        (["--log-level", "--json", "eval"], "argument --log-level: expected one argument"),
        (["--json", "eval", "run"], "unrecognized arguments: --json"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        out, err = capsys.readouterr()
        result = json.loads(out)
        assert set(result) == {"error", "exit_status"} and result["exit_status"] == 2, result
        assert result["error"].startswith(error), result
        assert err.startswith("usage: learner ") and f"error: {result['error']}\n" in err, err
    for argv in (
        ["--log-level", "bad", "eval", "run"],
        ["--log-level", "bad", "eval", "run", "--", "--json"],
        ["--log-level", "bad", "train", "--json"],
        ["--log", "bad", "train", "--json"],
        ["evl", "--json"],
        [],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("usage: learner "), (argv, out, err)
    for argv in (["--help", "eval", "--json"], ["eval", "--json", "--help"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith("usage: learner "), argv


def test_eval_json_prints_an_object_when_aborted_and_only_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C (or a first one while it starts, before a stop can be asked) aborts: --json printed
    nothing. Now an object saying so, with the status; none of its own where the result was being printed."""
    import learner.cli
    import learner.evaluate

    def aborted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(learner.evaluate, "evaluate", aborted)
    capsys.readouterr()
    assert main(["eval", str(tmp_path), "--backend", "gym", "--json"]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": "aborted", "exit_status": 130}, out
    assert err.strip().endswith("learner eval: aborted"), err
    assert main(["eval", str(tmp_path), "--backend", "gym"]) == 130  # (no --json: nothing on stdout)
    assert capsys.readouterr().out == ""
    # Aborted as the result was printed: that object alone.
    monkeypatch.setattr(learner.evaluate, "evaluate", lambda *a, **k: {"episodes": 1})
    printed = learner.cli._print_eval_result

    def print_then_abort(*args: Any, **kwargs: Any) -> None:
        printed(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(learner.cli, "_print_eval_result", print_then_abort)
    assert main(["eval", str(tmp_path), "--backend", "gym", "--json"]) == 130
    assert json.loads(capsys.readouterr().out) == {"episodes": 1, "exit_status": 0}


def test_eval_json_prints_one_whole_object_when_interrupted_as_it_prints_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object was noted printed before it was: a Ctrl-C whose KeyboardInterrupt came out of the write
    before it took the object left stdout without any. Now it is noted once written, and main prints the
    abort's, whole. A signal that comes as the write takes it is held until it is noted, then dropped: that
    object alone, no abort's after it (noted after the write, not with it, the two would be printed), and the
    exit status it says (it was 130, the object saying 0)."""
    import learner.evaluate

    monkeypatch.setattr(learner.evaluate, "evaluate", lambda *a, **k: {"episodes": 1})

    class Stdout(io.StringIO):
        """stdout, whose first write raises KeyboardInterrupt before it takes the text ("before"), or takes
        it as a SIGINT comes ("as"), which the command's handler raises KeyboardInterrupt for."""

        def __init__(self, interrupt: str | None) -> None:
            super().__init__()
            self.interrupt = interrupt

        def write(self, text: str) -> int:
            interrupt, self.interrupt = self.interrupt, None
            if interrupt == "before":
                raise KeyboardInterrupt
            written = super().write(text)
            if interrupt == "as":
                signal.raise_signal(signal.SIGINT)
            return written

    for interrupt, printed in (
        ("before", {"error": "aborted", "exit_status": 130}),
        ("as", {"episodes": 1, "exit_status": 0}),
        (None, {"episodes": 1, "exit_status": 0}),
    ):
        stdout = Stdout(interrupt)
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["eval", str(tmp_path), "--backend", "gym", "--json"]) == printed["exit_status"]
        out = stdout.getvalue()
        assert out.count("\n") == 1 and out.endswith("\n") and json.loads(out) == printed, (interrupt, out)
        assert capsys.readouterr().err.strip().endswith("aborted") == (interrupt == "before")


def test_eval_json_writes_its_whole_object_to_an_unbuffered_stdout_that_takes_part_of_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unbuffered (PYTHONUNBUFFERED, as the images set it), stdout's text layer hands a write to the raw file,
    whose write may take part of it (a signal as it waited for a slow reader): the rest was dropped, and the
    object cut short. Written through the binary layer until all of it is taken."""
    import learner.evaluate

    monkeypatch.setattr(learner.evaluate, "evaluate", lambda *a, **k: {"episodes": 1, "returns": [1.5] * 40})

    class Raw(io.RawIOBase):
        """A file that takes at most 7 bytes a write."""

        def __init__(self) -> None:
            self.taken = b""

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            part = bytes(data)[:7]
            self.taken += part
            return len(part)

    raw = Raw()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))  # type: ignore[type-var]
    assert main(["eval", str(tmp_path), "--backend", "gym", "--json"]) == 0
    assert json.loads(raw.taken) == {"episodes": 1, "returns": [1.5] * 40, "exit_status": 0}


def test_eval_whose_env_kwargs_change_the_spaces_says_they_may_be_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ClockEnv(action="box") has Box actions, where the policy's are Discrete(2): the error named the spaces
    alone, not the --env-kwargs given that changed them. On the envs eval makes, and on --video's."""
    _checkpoint(tmp_path, Args(env="tests.envs:ClockEnv", backend="gym"), *CLOCK_SPACES)
    box = ["--env-kwargs", '{"action": "box"}']
    capsys.readouterr()
    assert main(["eval", str(tmp_path), "--backend", "gym", *box]) == 1
    err = capsys.readouterr().err
    assert "but these envs (tests.envs:ClockEnv) have Box(0.0, 1.0, (2,), float32) and Box(-1.0, 1.0, (1,)" in err
    assert err.rstrip().endswith(
        '; they were made with --env-kwargs {"action": "box"}, not the run\'s {}, which may be what changed them: '
        "leave --env-kwargs out to make them as the run's"
    ), err
    assert main(["eval", str(tmp_path), "--backend", "gym", "--env-kwargs", '{"length": 4}']) == 0  # (same spaces)
    err = capsys.readouterr().err
    assert "--env-kwargs" not in err, err


def test_eval_whose_env_kwargs_change_the_video_env_s_spaces_says_they_may_be_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], start_servers: StartServers
) -> None:
    """As above, for --video's env, made here with the --env-kwargs given while the episodes run on servers
    (which make their own)."""
    _checkpoint(tmp_path, Args(env="tests.envs:ClockEnv", backend="gym"), *CLOCK_SPACES)
    (address,) = start_servers("tests.envs:ClockEnv", 1, 1)
    video = ["--video", str(tmp_path / "ep.gif"), "--env-kwargs", '{"action": "box"}']
    capsys.readouterr()
    assert main(["eval", str(tmp_path), "--servers", address, *video]) == 1
    err = capsys.readouterr().err
    assert "video: tests.envs:ClockEnv made here has observations" in err, err
    assert err.rstrip().endswith(
        '; they were made with --env-kwargs {"action": "box"}, not the run\'s {}, which may be what changed them: '
        "leave --env-kwargs out to make them as the run's"
    ), err
