"""``learner check``: an env checked through one real local env server against gymnasium's SyncVectorEnv of it."""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from learner.check import CheckOptions, _difference, run_check
from learner.cli import main
from tests.test_readme_snippets import snippet


def _children() -> set[str]:
    """This process's child processes (the local servers while they run)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    return {pid for task in tasks.iterdir() for pid in (task / "children").read_text().split()}


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    before = _children()
    status = main(["check", *argv, "--steps", "30"])
    assert _children() <= before  # (the server gone, however the check ended)
    return status, capsys.readouterr().out


def test_cartpole_passes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _check(capsys, "--env", "CartPole-v1")
    assert status == 0, out
    assert "ok       equivalence:      30 steps x 2 envs: observations, rewards, flags and infos the same" in out
    assert "reset(seed=0) twice gives the same observations" in out and "us per env-step" in out
    assert "ok       policy:           learner train takes it: an MLP, the classic preset" in out, out
    assert out.splitlines()[-1].startswith("CartPole-v1: passed")


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            "tests.envs:CameraClockEnv",
            "ok       policy:           learner train takes it: a Nature CNN for 'image' and an "
            "MLP on the Dict's keys, the classic preset",
        ),
        (
            "tests.envs:BoundsEnv",
            "warning  policy:           learner train refuses it: observation_space['camera']: uint8 images of shape "
            "(16, 16, 3) do not fit the Nature CNN",
        ),
    ],
)
def test_the_check_says_whether_learner_train_takes_the_spaces(
    capsys: pytest.CaptureFixture[str], env: str, said: str
) -> None:
    """A space the server serves but PPO cannot train (a camera too small for the Nature CNN, in a Dict) is a
    warning, not a failure; one it takes says with what."""
    status, out = _check(capsys, "--env", env)
    assert status == 0 and said in out, out


def test_an_info_value_sent_as_its_repr_is_a_warning_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _check(capsys, "--env", "tests.envs:UnsendableInfoEnv")
    assert status == 0, out
    assert "warning  equivalence:      info key 's': a builtins.set comes as its repr string" in out, out
    assert "info key 'd': a dict with keys that are not str comes with str(key) keys" in out
    # (the server's own warning, as an operator would see it)
    assert "server log:       WARNING env_server.service[local-0]: info key 's': a builtins.set cannot cross" in out


def test_an_env_not_reproducible_under_its_seed_is_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _check(capsys, "--env", "tests.envs:UnseededEnv")
    assert status == 0, out
    assert "warning  reproducibility:  reset(seed=0) twice gives other observations: seeded runs won't repeat" in out
    assert "observations, rewards, flags and infos of the same types, dtypes and shapes" in out


def test_an_env_that_raises_in_step_fails_the_check_naming_the_env(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _check(capsys, "--env", "tests.envs:FaultyEnv", "--env-kwargs", '{"raise_at": 5, "fault_env": -1}')
    assert status == 1, out
    assert "failed   equivalence:      in-process env 0's step raised ValueError: step 5 failed on purpose" in out, out
    assert "Traceback" not in out and out.splitlines()[-1].startswith("tests.envs:FaultyEnv: FAILED")


def test_an_env_that_cannot_be_built_fails_as_the_server_would(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _check(capsys, "--env", "tests.misbehaving_envs:NeedsArgs")
    assert status == 1
    assert "failed   build:            cannot make env 'tests.misbehaving_envs:NeedsArgs' with kwargs {}" in out, out


def test_a_difference_names_the_field_the_env_and_both_values() -> None:
    found = _difference(np.array([[0.5], [1.0]]), np.array([[0.5], [2.0]]), "observation", True, {})
    assert found == "observation, env 1: array([1.]) vs array([2.])"
    assert _difference({"k": np.array([1, 2])}, {"k": np.array([1.0, 2.0])}, "info", True, {}) == (
        "info['k']: int64 (2,) vs float64 (2,)"
    )


def test_help_says_what_it_checks() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "learner", "check", "--help"], check=True, capture_output=True, text=True
    ).stdout
    flat = " ".join(out.split())
    assert "--env ID" in flat and "gymnasium's env checker" in flat and "Exit status 0 when no check failed" in flat


def test_the_readmes_env_passes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README "Your own env": ``learner check --env myenvs:GoRight --max-episode-steps 200`` passes."""
    (tmp_path / "myenvs.py").write_text(snippet("myenvs.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    status, out = _check(capsys, "--env", "myenvs:GoRight", "--max-episode-steps", "200")
    assert status == 0 and "gymnasium's env checker found nothing" in out and "passed (0 warnings)" in out, out


def test_an_info_key_of_ints_then_floats_is_no_difference(capsys: pytest.CaptureFixture[str]) -> None:
    """FrozenLake's ``prob`` (an int 1 after a reset, 0.333 after a step): the server widens it to float64, as the
    learner's --backend gym does; gymnasium's own SyncVectorEnv cut it to the first env's int64 (a false failure)."""
    status, out = _check(capsys, "--env", "FrozenLake-v1")
    assert status == 0 and "30 steps x 2 envs: observations, rewards, flags and infos the same" in out, out
    status, out = _check(capsys, "--env", "tests.envs:MixedInfoEnv")
    assert status == 0, out


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # (a BaseException of the env's: was a traceback, in the build and in gymnasium's env checker)
        (
            "BuildCancelled",
            "failed   build:            cannot make env 'tests.misbehaving_envs:BuildCancelled': Cancel",
        ),
        ("StepRaisesBase", "failed   equivalence:      in-process env 0's step raised MyBaseError: custom (at step 2"),
        ("ResetRaisesBase", "failed   equivalence:      in-process env 0's reset raised CancelledError"),
        # (what gymnasium's vector env refuses in the first reset: was a traceback, or numpy's ValueError taken for a
        # usage error, exit status 2)
        ("ResetInfoNotDict", "failed   equivalence:      in-process SyncVectorEnv's reset: AttributeError: 'list'"),
        ("ObsNone", "failed   equivalence:      in-process env 0: its reset returned None, not an observation"),
    ],
)
def test_what_an_env_raises_or_returns_wrong_is_a_failed_check_not_a_traceback(
    capsys: pytest.CaptureFixture[str], env: str, expected: str
) -> None:
    status, out = _check(capsys, "--env", f"tests.misbehaving_envs:{env}")
    assert status == 1 and expected in out and out.splitlines()[-1].endswith(")"), out
    assert "Traceback" not in capsys.readouterr().err


def test_an_env_whose_close_raises_is_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _check(capsys, "--env", "tests.misbehaving_envs:CloseRaises")
    assert status == 0, out
    assert "warning  close:            the env's close raised RuntimeError: close failed" in out
    assert "warning  close:            the in-process envs' close raised RuntimeError: close failed" in out


def test_ctrl_c_in_an_env_that_hangs_shows_the_lines_found_and_leaves_no_server() -> None:
    """The lines are printed as found: an env whose step hangs shows how far the check got (for the server's
    --hang-timeout, 60 s); they were all printed at the end, so a Ctrl-C then left nothing on the screen."""
    check = subprocess.Popen(
        [
            *(sys.executable, "-m", "learner", "check", "--env", "tests.envs:FaultyEnv", "--steps", "50"),
            *("--env-kwargs", '{"hang_at": 10, "fault_env": -1}'),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert check.stdout is not None and check.stderr is not None
    seen, servers = "", set()
    with selectors.DefaultSelector() as sel:
        sel.register(check.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60.0
        while (
            "reproducibility:" not in seen and time.monotonic() < deadline and sel.select(deadline - time.monotonic())
        ):
            seen += os.read(check.stdout.fileno(), 65536).decode()  # (no readline: its buffer would hide lines)
            tasks = Path(f"/proc/{check.pid}/task")
            servers |= {pid for task in tasks.iterdir() for pid in (task / "children").read_text().split()}
    try:
        assert "ok       server:" in seen and "reproducibility:" in seen, seen
        check.send_signal(signal.SIGINT)
        _, err = check.communicate(timeout=30)
    finally:
        check.kill()
    assert check.returncode in (-signal.SIGINT, 130) and "Traceback" not in err and "aborted" in err, err
    assert len(servers) >= 2, servers  # (the server, and the check's worker process: its env hangs there too)
    assert not any(Path(f"/proc/{pid}").exists() for pid in servers)


def test_nan_observations_and_rewards_pass_with_a_warning_that_training_stops_on_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same through a server (no difference), but learner train and eval stop on them: a plain pass was a false
    pass (README: Your own env). A Dict observation's warning names its key, as learner train's refusal does."""
    status, out = _check(capsys, "--env", "tests.numeric_envs:ExtremeEnv", "--env-kwargs", '{"obs": NaN}')
    assert status == 0, out
    assert "warning  usable:           observation of env 1 at step 1 has NaN or infinite values (array([nan" in out
    # A Dict observation's warning names the key (was: "observation of env 0", whichever key it was).
    status, out = _check(capsys, "--env", "tests.envs:CameraClockEnv", "--env-kwargs", '{"nan_at": 1}')
    assert status == 0, out
    assert "warning  usable:           observation['state'] of env 0 at step 1 has NaN or infinite values" in out, out
    status, out = _check(capsys, "--env", "tests.output_envs:OutputEnv", "--env-kwargs", '{"reward": "nan"}')
    assert status == 0 and "reward of env 1 at step 2 is nan: learner train and eval stop on it" in out, out


def test_an_env_whose_step_hangs_fails_by_the_servers_hang_timeout() -> None:
    """The served step goes first, where --hang-timeout ends a hung env call; the in-process one hung for ever."""
    result = run_check(
        CheckOptions("tests.envs:FaultyEnv", env_kwargs={"hang_at": 10, "fault_env": -1}, steps=30, hang_timeout=2.0)
    )
    failed = [line.message for line in result.lines if line.status == "failed"]
    assert result.failed and failed[0].startswith("served: env server local-0: ") and "(at step 10)" in failed[0]
    # (that failure says the server went; a line says why, the hang, not the step socket broken)
    assert re.fullmatch(
        r"the env hung: the envs' step has run for [\d.]+ s, longer than --hang-timeout 2 s \(where: the server log "
        r"below\)",
        failed[1],
    ), failed
    logged = [line.message for line in result.lines if line.check == "server log"]
    assert any("longer than --hang-timeout 2 s" in text and "tests/envs.py" in text for text in logged), logged


def test_strings_not_valid_unicode_are_warnings_as_the_readme_says(capsys: pytest.CaptureFixture[str]) -> None:
    """README "Your own env": a str with a lone surrogate comes as its repr, a key with one backslash-escaped; the
    check failed them as differences ("info: keys [...'k\\udce9'...] vs [...'k\\\\udce9'...]")."""
    status, out = _check(capsys, "--env", "tests.envs:NotUnicodeEnv", "--env-kwargs", '{"raise_at": 1000}')
    assert status == 0, out
    assert "info key 'k\\\\udce9': a key not valid Unicode comes escaped (README: Your own env)" in out, out
    assert "info key 's': a builtins.str comes as its repr string" in out
    assert "info key 'u': a numpy.str_ comes as its repr string" in out


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
@pytest.mark.parametrize(("env", "steps"), [("CartPole-v1", "100"), ("tests.envs:DictEnv", "30")])
def test_the_mode_the_operator_serves_is_the_one_compared(
    capsys: pytest.CaptureFixture[str], env: str, steps: str, mode: str, vectorization: str
) -> None:
    """``--vectorization`` and ``--autoreset-mode`` as env-server takes them: the server steps so, and the in-process
    reference resets as it does (DictEnv's episodes end within 25 steps; CartPole's random ones within ~20), Disabled's
    ended envs reset by both sides."""
    before = _children()
    status = main(["check", "--env", env, "--steps", steps, "--vectorization", vectorization, "--autoreset-mode", mode])
    out = capsys.readouterr().out
    assert _children() <= before and status == 0, out
    assert f"{steps} steps x 2 envs: observations, rewards, flags and infos the same" in out, out


@pytest.mark.parametrize(
    "modes", [["--autoreset-mode", "SameStep"], ["--autoreset-mode", "Disabled", "--vectorization", "async"]]
)
def test_a_difference_after_an_autoreset_is_caught_in_a_mode_not_the_default(
    capsys: pytest.CaptureFixture[str], modes: list[str]
) -> None:
    """ServedDiffersEnv's second episode starts elsewhere when served: SameStep shows it in the step that ended the
    first (its observation is the reset's), Disabled in the reset of the envs that ended."""
    status, out = _check(capsys, "--env", "tests.envs:ServedDiffersEnv", *modes)
    assert status == 1, out
    where = "step 3: " if "SameStep" in modes else "step 3: the reset of the envs that ended then: "
    assert f"failed   equivalence:      {where}observation, env 0: array([0., 1.], dtype=float32) vs array([0.33" in out


def test_vector_entry_point_is_compared_by_types_with_a_warning_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    """CartPole's own batched env draws from other random streams than gymnasium's per-env seeding (env-server
    --help): not comparable value for value, which is no failure."""
    status, out = _check(capsys, "--env", "CartPole-v1", "--vectorization", "vector_entry_point")
    assert status == 0, out
    assert "warning  equivalence:      --vectorization vector_entry_point: the env's own batched implementation" in out
    assert "30 steps x 2 envs: observations, rewards, flags and infos of the same types, dtypes and shapes" in out


def test_check_takes_the_servers_stepping_options_as_env_server_does() -> None:
    """One definition (env_server.config.add_stepping_option): the same choices, defaults and help texts."""
    from env_server.__main__ import build_parser as server_parser
    from learner.cli import build_parser

    check = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["check"]
    for flag in ("--vectorization", "--autoreset-mode"):
        ours = next(a for a in check._actions if flag in a.option_strings)
        theirs = next(a for a in server_parser()._actions if flag in a.option_strings)
        assert (ours.choices, ours.default, ours.help) == (theirs.choices, theirs.default, theirs.help), flag


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"how": "segfault"},
            "failed   equivalence:      the env killed the check's worker process: signal 11 (SIGSEGV) during the "
            "in-process step 11",
        ),
        (
            {"how": "exit"},
            "failed   equivalence:      the env killed the check's worker process: exit code 7 during the in-process "
            "step 11",
        ),
        (
            {"how": "hang"},
            "failed   equivalence:      the env hung in the check's worker process: the in-process step 11 ran for "
            "longer than --hang-timeout 2 s (the process killed)",
        ),
        (
            {"how": "hang", "at": 0},  # (in every reset: gymnasium's env checker's first)
            "failed   build:            the env hung in the check's worker process: the build and gymnasium's env "
            "checker ran for longer than --hang-timeout 2 s (the process killed)",
        ),
        (
            {"how": "segfault", "at": 0},
            "failed   build:            the env killed the check's worker process: signal 11 (SIGSEGV) during the "
            "build and gymnasium's env checker",
        ),
    ],
)
def test_an_env_that_kills_or_hangs_the_checks_own_side_fails_the_check_with_its_verdict(
    capsys: pytest.CaptureFixture[str], kwargs: dict[str, object], expected: str
) -> None:
    """The env checker and the in-process vector env run in a worker process: an env that ends its process (a
    segfault, os._exit) or hangs there ended the check with no verdict, or blocked it. (FailsInProcess does so
    in-process only: served, it steps on, so the worker's line is the one that fails.)"""
    env = "tests.misbehaving_envs:FailsInProcess"
    status, out = _check(capsys, "--env", env, "--env-kwargs", json.dumps(kwargs), "--hang-timeout", "2")
    assert status == 1 and expected in out, out
    assert out.splitlines()[-1] == f"{env}: FAILED (0 warnings)"


def test_a_value_pickle_cannot_carry_back_from_the_worker_comes_as_its_repr() -> None:
    """The worker's answers are pickled: a value that cannot be (a lock in an info) comes as its repr and type, as the
    server sends it, so the comparison says what it says of it in-process (README: Your own env)."""
    import pickle
    import threading

    from learner.check import _pickled

    lock = threading.Lock()
    answer = pickle.loads(_pickled(("ok", ({"lock": lock, "n": np.arange(2)}, {}))))
    assert repr(answer[1][0]["lock"]) == repr(lock) and answer[1][0]["lock"].kind == "_thread.lock"
    assert (answer[1][0]["n"] == np.arange(2)).all()
    notes: dict[str, str] = {}
    assert _difference(answer[1][0]["lock"], repr(lock), "info['lock']", True, notes) is None
    assert notes == {"lock": "a _thread.lock comes as its repr string"}


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("exception", "warning  equivalence:      info key 'err': a tests.envs._CodedError comes as its repr string"),
        (
            "runtime_module",
            "failed   equivalence:      in-process SyncVectorEnv at step 1: the worker's answer cannot be read in the "
            "check's process: ModuleNotFoundError: No module named 'made_at_run_time'",
        ),
    ],
)
def test_an_info_that_pickles_but_cannot_be_unpickled_is_a_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], kind: str, expected: str
) -> None:
    """The worker's answers are pickled: a value that pickles but unpickles with an error (an exception whose __init__
    takes other arguments than its args: TypeError) raised out of the check with a traceback. The worker reads its
    answer back first: such a value comes as its repr, as the server sends it. One that only the worker's process
    can read (a class of a module it made at run time) is a failed line."""
    status, out = _check(capsys, "--env", "tests.envs:UnpicklableInfoEnv", "--env-kwargs", json.dumps({"kind": kind}))
    assert expected in out, out
    assert status == (0 if kind == "exception" else 1), out


def test_a_tuple_subclass_pickle_cannot_carry_back_comes_as_its_repr() -> None:
    """A namedtuple whose class pickle cannot find (made in a function) was rebuilt from one argument, its items'
    iterable: a TypeError that ended the worker, and the check said the env had killed it ("exit code 1")."""
    import collections
    import pickle
    import threading

    from learner.check import _pickled, _Unpicklable

    pair = collections.namedtuple("pair", "a b")  # (as an env's info might hold one)
    lock = threading.Lock()
    answer = pickle.loads(_pickled(("ok", {"pair": pair(1, lock), "list": [1, lock]})))
    assert isinstance(answer[1]["pair"], _Unpicklable) and repr(answer[1]["pair"]) == f"pair(a=1, b={lock!r})"
    assert answer[1]["list"][0] == 1 and repr(answer[1]["list"][1]) == repr(lock)
    found = _difference(answer[1]["pair"], (1, 2), "info['pair']", True, {})
    assert found is not None and found.startswith("info['pair']: pair pair(a=1, b=<unlocked _thread.lock"), found
