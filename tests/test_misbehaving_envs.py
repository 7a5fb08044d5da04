"""Env classes that break gymnasium's Env API (tests/misbehaving_envs.py) get an error naming what the env did, as
that env's error where the server can go on, and the server survives: a BaseException of the env's, an info that
is no dict, the old gym API's reset and step, an observation_space changed after the build; async vectorization
recovers from an error in gymnasium's own code, and says it cannot go on when a worker is gone."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import re
import signal
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import pytest

from env_server import ServerConfig, build_vector_env
from env_server.envs import EnvBuildError, ObservationLayoutError, _TrackedPipe
from env_server.health import check
from env_server.isolation import ENV_ERROR_KEY, IsolateErrors, tell_positions
from learner import EnvCrashedError, RemoteVectorEnv
from tests.conftest import SpawnServer

pytestmark = pytest.mark.timeout(120)  # (a wedged async vector env waits for good)

M = "tests.misbehaving_envs"
VECTORIZATIONS = pytest.mark.parametrize("vectorization", ["sync", "async"])


@contextlib.contextmanager
def vector_env(env: str, num_envs: int = 2, vectorization: str = "sync", **kwargs: Any) -> Iterator[Any]:
    config = ServerConfig(env=f"{M}:{env}", num_envs=num_envs, env_kwargs=kwargs, vectorization=vectorization)
    envs = build_vector_env(config)
    tell_positions(envs)
    try:
        yield envs
    finally:
        # (async: without waiting for a reply still due, which a wedged vector env waited for on a pipe read already)
        envs.close(terminate=vectorization == "async")


def step(envs: Any) -> tuple[Any, ...]:
    return envs.step(np.zeros(envs.num_envs, dtype=np.int64))


def errors(infos: dict[str, Any]) -> list[str | None]:
    mask = infos.get("_" + ENV_ERROR_KEY)
    if mask is None:
        return [None] * len(next(iter(infos.values()), [None, None]))
    return [str(infos[ENV_ERROR_KEY][i]) if mask[i] else None for i in range(len(mask))]


# ---- 1. a BaseException of the env's is that env's error -------------------------------------------------------


@VECTORIZATIONS
@pytest.mark.parametrize(
    ("what", "kind"),
    [
        ("cancelled", "CancelledError"),
        ("generator_exit", "GeneratorExit"),
        ("own", "MyBaseError"),
    ],
)
def test_a_base_exception_in_step_is_that_envs_error(what: str, kind: str, vectorization: str) -> None:
    """It escaped the isolation: the whole batch failed (sync), or the async worker died without a word."""
    with vector_env("StepRaisesBase", vectorization=vectorization, what=what) as envs:
        envs.reset(seed=0)
        step(envs)
        _, rewards, _, truncations, infos = step(envs)
        assert all(
            e is not None and e.startswith(f"step: {kind} (a BaseException the env raised)") for e in errors(infos)
        )
        assert truncations.all() and not rewards.any()
        envs.reset(seed=0)  # (and the envs go on)
        step(envs)


def test_a_base_exception_in_reset_leaves_the_env_out_of_order() -> None:
    with vector_env("ResetRaisesBase") as envs:
        _, infos = envs.reset(seed=0)
        assert errors(infos) == ["reset: CancelledError (a BaseException the env raised)"] * 2
        assert str(errors(step(envs)[4])[0]).startswith("out of order since reset: CancelledError")


# ---- 2. an info that is no dict ------------------------------------------------------------------------------------

STEP_INFO = (
    r"step: TypeError: step\(\) returned info of type {0}: expected a dict \(gymnasium's \(obs, reward, terminated, "
    r"truncated, info\)\)"
)


@VECTORIZATIONS
@pytest.mark.parametrize("info", ["list", "str"])
def test_a_step_info_that_is_no_dict_is_that_envs_error(info: str, vectorization: str) -> None:
    """Not "AttributeError: 'list' object has no attribute 'items'" failing the whole batch."""
    with vector_env("StepInfoNotDict", vectorization=vectorization, info=info) as envs:
        envs.reset(seed=0)
        step(envs)
        found = errors(step(envs)[4])
        assert all(e is not None and re.fullmatch(STEP_INFO.format(info), e) for e in found), found
        step(envs)


def test_a_reset_info_that_is_no_dict_is_that_envs_error() -> None:
    with vector_env("ResetInfoNotDict") as envs:
        _, infos = envs.reset(seed=0)
        expected = "reset: TypeError: reset() returned info of type list: expected a dict (gymnasium's (obs, info))"
        assert errors(infos) == [expected] * 2


def test_a_server_reports_an_info_that_is_no_dict_as_that_envs_error(spawn_server: SpawnServer) -> None:
    """The whole batch failed: learner train reconnected as for an outage, then stopped with "every env's server
    was unavailable"."""
    server = spawn_server(f"{M}:StepInfoNotDict", 2)
    with RemoteVectorEnv([server.address], fault_tolerant=True) as envs:
        envs.reset(seed=0)
        step(envs)
        found = errors(step(envs)[4])
        assert all(e is not None and re.fullmatch(STEP_INFO.format("list"), e) for e in found), found
        assert envs.fault_stats().failures == 0
        step(envs)
    assert check(server.address) == "SERVING"
    assert "step returned what cannot be stored: step() returned info of type list" in server.logs()


def test_the_gym_backend_reports_an_info_that_is_no_dict_as_that_envs_error() -> None:
    """It crashed with a raw traceback from _widen_infos."""
    from learner.envs import FleetSpec, open_fleet

    spec = FleetSpec(env=f"{M}:StepInfoNotDict", backend="gym", num_servers=1, envs_per_server=2)
    with open_fleet(spec) as envs:
        envs.reset(seed=0)
        step(envs)
        assert all(e is not None and re.fullmatch(STEP_INFO.format("list"), e) for e in errors(step(envs)[4]))


# ---- 3. async vectorization after an error ------------------------------------------------------------------------


def test_async_vectorization_recovers_from_an_error_in_gymnasiums_step_wait() -> None:
    """Env 1's info value is a str where env 0's was an int: gymnasium's step_wait fails storing it, with env 2's
    reply unread and its state left WAITING_STEP: every later reset was AlreadyPendingCallError."""
    with vector_env("InfoTypesDiffer", num_envs=3, vectorization="async") as envs:
        envs.reset(seed=0)
        with pytest.raises(ValueError):
            step(envs)
        obs, infos = envs.reset(seed=2)  # (seeds 2, 3, 4: ints first again, then a str)
        assert obs.shape == (3, 2) and ENV_ERROR_KEY not in infos
        with pytest.raises(ValueError):
            step(envs)
        envs.reset(seed=0)


def test_an_async_server_serves_on_after_an_error_in_gymnasiums_step_wait(spawn_server: SpawnServer) -> None:
    server = spawn_server(f"{M}:InfoTypesDiffer", 3, "--vectorization", "async")
    with RemoteVectorEnv([server.address], fault_tolerant=False) as envs:
        envs.reset(seed=0)
        with pytest.raises(EnvCrashedError, match="ValueError"):
            step(envs)
        envs.reset(seed=0)  # (was: AlreadyPendingCallError, for good)
    assert check(server.address) == "SERVING"


@pytest.mark.slow
def test_an_async_server_whose_worker_died_says_it_cannot_go_on(spawn_server: SpawnServer) -> None:
    """A worker gone without a word (os._exit, a segfault, the OOM killer): the server answered every later reset
    AlreadyPendingCallError and stayed up, saying nothing, so that no supervisor restarted it."""
    server = spawn_server(f"{M}:StepExits", 2, "--vectorization", "async")
    with RemoteVectorEnv([server.address], fault_tolerant=False) as envs:
        envs.reset(seed=0)
        step(envs)
        with pytest.raises(EnvCrashedError, match="EOFError"):
            step(envs)
        with pytest.raises(EnvCrashedError, match=r"worker processes ended .*restart it") as raised:
            envs.reset(seed=0)
        assert "AlreadyPendingCallError" not in str(raised.value)
    assert check(server.address) == "NOT_SERVING"


class _RecordingPipe:
    """A pipe's end that records the type of what it is given to send."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.sent: list[type] = []

    def send_bytes(self, data: Any) -> None:
        self.sent.append(type(data))
        self.pipe.send_bytes(data)


def test_a_send_to_a_worker_gone_leaves_the_garbage_collector_no_view_of_a_bytesio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send that raises keeps what it sent in its traceback's frames; there, in a reference cycle (EnvThread.call
    re-raises the error from a variable), a view of ForkingPickler.dumps' BytesIO made the garbage collector print
    "Exception ignored ... BufferError" (Python 3.13), or crash the server closing its envs after a worker had died
    (3.12.1: CPython's gh-111049). Bytes are sent, which Python 3.11 did not need, so they are checked too."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    ours, theirs = multiprocessing.Pipe()
    theirs.close()  # (the worker gone)
    recording = _RecordingPipe(ours)

    def send_keeping_the_error() -> None:
        try:
            _TrackedPipe(recording).send(("step", np.zeros(4)))
        except OSError as err:
            error = err
        raise error  # (a cycle: the error's traceback holds this frame, which holds the error)

    with pytest.raises(BrokenPipeError):
        send_keeping_the_error()
    gc.collect()
    assert recording.sent == [bytes] and unraisable == []
    ours.close()


def test_a_recovery_kills_a_worker_whose_env_does_not_answer_in_time(caplog: pytest.LogCaptureFixture) -> None:
    """Env 0's worker dies in a step, env 1's hangs: the recovery waited for env 1's reply for ever (the server's
    step with it), polling a worker that was alive."""
    with caplog.at_level(logging.ERROR), vector_env("ExitsOrHangs", vectorization="async") as envs:
        base = envs.unwrapped
        base.recover_timeout_s = 0.5
        envs.reset(seed=0)
        step(envs)
        raised: list[BaseException] = []

        def stepping() -> None:
            try:
                step(envs)
            except BaseException as err:
                raised.append(err)

        thread = threading.Thread(target=stepping, daemon=True)
        thread.start()
        thread.join(timeout=60.0)
        if thread.is_alive():
            for process in base.processes:  # (so that the step, and the close, end)
                process.kill()
            thread.join(timeout=30.0)
            pytest.fail("the recovery still waited for the hung worker after 60 s")
        assert [type(err) for err in raised] == [EOFError]
        assert base.parent_pipes == [None, None] and not base.processes[1].is_alive()
    assert "the worker of env 1 had not answered 0.5 s after an error" in caplog.text
    assert "killed it" in caplog.text


def test_a_recovery_logs_each_workers_failure_with_its_own_env(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Envs 2 then 1 fail while the server reads env 0's reply (its worker gone): the recovery took the error queue's
    first report (env 2's) for env 1's, logging "the worker of env 1 failed: the server's env 2: ..."."""
    with (
        caplog.at_level(logging.ERROR, logger="env_server.envs"),
        vector_env("FailInTurn", num_envs=3, vectorization="async", path=str(tmp_path / "pid")) as envs,
    ):
        envs.reset(seed=0)
        step(envs)
        with pytest.raises(EOFError):
            step(envs)
    failed = {
        int(match[1]): match[2]
        for record in caplog.records
        if (match := re.match(r"async vectorization: the worker of env (\d+) failed: (.*)", record.getMessage()))
    }
    assert sorted(failed) == [1, 2], caplog.text
    for index, error in failed.items():
        assert error.startswith(f"the server's env {index}: its step returned"), (index, error)


class _Interrupted(Exception):
    """What the test's SIGUSR1 handler raises."""


def test_an_error_in_set_attr_leaves_no_reply_for_the_next_call(tmp_path: Path) -> None:
    """set_attr interrupted while the workers set their attribute: the replies still due were taken by the next
    reset for its own (and it failed: "'NoneType' object is not iterable")."""
    released = tmp_path / "released"

    def interrupt(signum: int, frame: Any) -> None:
        released.touch()  # (the workers go on: their replies come)
        raise _Interrupted

    before = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with vector_env("HoldsSetAttr", vectorization="async") as envs:
            envs.reset(seed=0)
            with pytest.raises(_Interrupted):
                # (env 0's worker holds until then, so the interrupt comes while set_attr waits for its reply; env 1's,
                # the last sent, sends the signal)
                envs.unwrapped.set_attr("hold", [(0, str(released)), (os.getpid(), str(released))])
            obs, infos = envs.reset(seed=0)
            assert obs.shape == (2, 2) and ENV_ERROR_KEY not in infos
            step(envs)
    finally:
        signal.signal(signal.SIGUSR1, before)


# ---- 4. the old gym API ------------------------------------------------------------------------------------------

OLD_HINT = "this looks like the old gym API (wrap the env with shimmy's GymV21CompatibilityV0"


@VECTORIZATIONS
def test_an_old_gym_reset_is_named_not_unpacked(vectorization: str) -> None:
    """An observation of shape (2,) was unpacked into obs=obs[0], info=obs[1], and the error blamed a shape ()
    observation."""
    with vector_env("OldGymReset", vectorization=vectorization) as envs:
        _, infos = envs.reset(seed=0)
        for found in errors(infos):
            assert found is not None and found.startswith(
                "reset: TypeError: reset() returned an ndarray of shape (2,), not a tuple (obs, info): gymnasium's "
                "Env API (0.26+) has reset return (obs, info); " + OLD_HINT
            ), found


@VECTORIZATIONS
def test_an_old_gym_step_is_named(vectorization: str) -> None:
    """Was: "not enough values to unpack (expected 5, got 4)"."""
    with vector_env("OldGymStep", vectorization=vectorization) as envs:
        envs.reset(seed=0)
        for found in errors(step(envs)[4]):
            assert found is not None and found.startswith(
                "step: TypeError: step() returned 4 values (obs, reward, done, info: the old gym API): expected 5 "
                "(obs, reward, terminated, truncated, info); " + OLD_HINT
            ), found


OLD_FIX = "wrap the env with shimmy's GymV21CompatibilityV0, gymnasium.make('GymV21Environment-v0', env=...)"


@VECTORIZATIONS
def test_an_old_gym_reset_of_a_pair_says_its_info_is_no_dict_and_how_to_wrap_the_env(vectorization: str) -> None:
    """An observation (1, 2) of Tuple((Discrete(3), Discrete(4))), alone, was "info of type int", without the old API."""
    with vector_env("OldGymPairReset", vectorization=vectorization) as envs:
        _, infos = envs.reset(seed=0)
        for found in errors(infos):
            assert found is not None and found.startswith(
                "reset: TypeError: reset() returned info of type int: expected a dict (gymnasium's (obs, info)); if "
                "the env uses the old gym API (its reset returning the observation alone, here (1, 2) of type tuple), "
                + OLD_FIX
            ), found


def test_a_reset_that_takes_no_seed_or_options_is_named_with_gymnasiums_signature(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was Python's own "ResetTakesNoKeywords.reset() got an unexpected keyword argument 'seed'"."""
    from env_server import isolation

    monkeypatch.setattr(isolation, "_error_log", isolation._ErrorLog())  # (this process's first errors: logged)
    signature = "gymnasium calls reset(seed=..., options=...), its signature is reset(self, *, seed=None, options=None)"
    with caplog.at_level(logging.WARNING), vector_env("ResetTakesNoKeywords") as envs:
        _, infos = envs.reset(seed=0)
        expected = (
            "reset: TypeError: ResetTakesNoKeywords.reset() does not take the keyword arguments 'seed' and 'options': "
            f"{signature}; {OLD_HINT}"
        )
        assert all(found is not None and found.startswith(expected) for found in errors(infos)), errors(infos)
    assert "reset cannot be called: ResetTakesNoKeywords.reset() does not take" in caplog.text
    assert "Traceback" not in caplog.text
    with vector_env("ResetTakesNoOptions") as envs:
        _, infos = envs.reset(seed=0)
        expected = (
            f"reset: TypeError: ResetTakesNoOptions.reset() does not take the keyword argument 'options': {signature}"
        )
        assert errors(infos) == [expected] * 2


class _CallsResetBare(gym.Wrapper[Any, Any, Any, Any]):
    """A wrapper that calls its env's reset with no arguments (its env's reset then runs)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.env.reset(), {}


class _ResetRaisesATypeError(gym.Env[Any, Any]):
    """A reset without gymnasium's keywords, whose own code raises a TypeError about a keyword argument."""

    observation_space = gym.spaces.Discrete(3)
    action_space = gym.spaces.Discrete(2)

    def reset(self) -> Any:  # type: ignore[override]
        return sorted([1], reversed=True)  # type: ignore[call-overload]


def test_a_type_error_raised_inside_a_reset_without_gymnasiums_keywords_is_its_own() -> None:
    """Only Python's error binding the call is named as the signature's: a TypeError the reset's code raised is itself."""
    env = IsolateErrors(_CallsResetBare(_ResetRaisesATypeError()), repeat_on_reset=False)
    found = env.reset(seed=0)[1][ENV_ERROR_KEY]
    assert re.fullmatch(r"reset: TypeError: [^:]*\breversed\b[^:]*", found), found  # (Python's words for sort())
    # (called with gymnasium's keywords, the same reset is named)
    named = IsolateErrors(_ResetRaisesATypeError(), repeat_on_reset=False).reset(seed=0)[1][ENV_ERROR_KEY]
    assert named.startswith("reset: TypeError: _ResetRaisesATypeError.reset() does not take the keyword"), named


class _PassesAKeywordItsEnvLacks(gym.Wrapper[Any, Any, Any, Any]):
    """A wrapper whose reset passes its env a keyword that is none of gymnasium's (a bug of the wrapper's)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.env.reset(level=3)  # type: ignore[call-arg]


def test_another_keywords_error_is_not_pinned_on_a_reset_lacking_gymnasiums() -> None:
    """The deeper reset lacks seed and options, but the TypeError is of the wrapper's own keyword, 'level'."""
    found = IsolateErrors(_PassesAKeywordItsEnvLacks(_ResetRaisesATypeError()), repeat_on_reset=False).reset(seed=0)
    assert re.fullmatch(r"reset: TypeError: .*unexpected keyword argument 'level'", found[1][ENV_ERROR_KEY]), found


# ---- 5. "returned", not "raised" --------------------------------------------------------------------------------


def test_error_phrase_says_returned_for_what_the_env_returned() -> None:
    from env_server.isolation import error_phrase

    assert error_phrase("step: ValueError: boom") == "raised in step: ValueError: boom"
    assert error_phrase("step: TypeError: step() returned reward None: expected a number (a float)") == (
        "returned in step what cannot be used: TypeError: step() returned reward None: expected a number (a float)"
    )
    assert error_phrase("reset: ReservedInfoKeyError: x").startswith("returned in reset what cannot be used")
    assert error_phrase("out of order since reset: ValueError: x") == "is out of order since reset: ValueError: x"


def test_the_servers_log_says_returned_for_what_the_env_returned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from env_server import isolation

    monkeypatch.setattr(isolation, "_error_log", isolation._ErrorLog())  # (this process's first errors: logged)
    with caplog.at_level(logging.WARNING), vector_env("OldGymReset") as envs:
        envs.reset(seed=0)
    assert "reset returned what cannot be used: reset() returned an ndarray" in caplog.text
    assert "raised in reset" not in caplog.text


# ---- 6. the first observation's check names what came -----------------------------------------------------------


@pytest.mark.parametrize(("env", "named"), [("ObsNone", "None, not an observation"), ("ObsDict", "dtype dict")])
def test_the_first_observations_check_names_what_came(env: str, named: str) -> None:
    """Was "observation has shape (), expected (2,)" for both."""
    with vector_env(env) as envs, pytest.raises(ObservationLayoutError, match=re.escape(named)):
        envs.reset(seed=0)


# ---- 7. an observation_space changed after the build -------------------------------------------------------------

CHANGED = (
    "reset: SpaceChangedError: env {0}'s observation_space changed after it was built (Box(-1.0, 1.0, (2,), float32) "
    "-> Box(-1.0, 1.0, (3,), float32)); spaces must be set in __init__ and stay fixed"
)


@VECTORIZATIONS
def test_an_observation_space_changed_after_the_build_is_that_envs_error(vectorization: str) -> None:
    """Was numpy's "Output array is the wrong shape" (sync) or "could not broadcast input array" (async)."""
    with vector_env("SpaceChanges", vectorization=vectorization) as envs:
        obs, infos = envs.reset(seed=0)
        assert errors(infos) == [CHANGED.format(0), CHANGED.format(1)]
        assert obs.shape == (2, 2)
        step(envs)


def test_a_server_reports_an_observation_space_changed_as_that_envs_error(spawn_server: SpawnServer) -> None:
    """Was retried as an outage until --give-up-after (a minute)."""
    server = spawn_server(f"{M}:SpaceChanges", 1)
    with RemoteVectorEnv([server.address], fault_tolerant=True) as envs:
        _, infos = envs.reset(seed=0)
        assert errors(infos) == [CHANGED.format(0)]
        assert envs.fault_stats().failures == 0
    assert check(server.address) == "SERVING"


def test_the_gym_backend_reports_an_observation_space_changed_as_that_envs_error() -> None:
    from learner.envs import FleetSpec, open_fleet

    spec = FleetSpec(env=f"{M}:SpaceChanges", backend="gym", num_servers=1, envs_per_server=1)
    with open_fleet(spec) as envs:
        assert errors(envs.reset(seed=0)[1]) == [CHANGED.format(0)]


# ---- 8. a close() that raises in --backend gym -------------------------------------------------------------------


def test_the_gym_backend_warns_of_a_close_that_raises(caplog: pytest.LogCaptureFixture) -> None:
    """A finished run (checkpoints, summary.json) became a traceback and exit status 1."""
    from learner.envs import FleetSpec, open_fleet

    spec = FleetSpec(env=f"{M}:CloseRaises", backend="gym", num_servers=1, envs_per_server=1)
    with open_fleet(spec) as envs:
        envs.reset(seed=0)
    assert "the env's close() raised RuntimeError: close failed; the run is complete" in caplog.text


# ---- 9. a segfault leaves the Python stack in the server's log ---------------------------------------------------


@pytest.mark.slow
def test_a_segfaulting_env_leaves_its_stack_in_the_servers_log(spawn_server: SpawnServer) -> None:
    server = spawn_server(f"{M}:StepSegfaults", 1)
    with RemoteVectorEnv([server.address], fault_tolerant=False) as envs:
        envs.reset(seed=0)
        step(envs)
        with contextlib.suppress(Exception):
            step(envs)
    assert server.proc is not None
    server.proc.wait(timeout=60)
    logs = server.logs()
    assert "Fatal Python error: Segmentation fault" in logs and "misbehaving_envs.py" in logs, logs[-2000:]


# ---- 10. start-up messages ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "which"), [("NoneSpace", "observation_space"), ("NoneActionSpace", "action_space")])
def test_a_space_that_is_none_is_named(env: str, which: str) -> None:
    """Was "cannot make env ... with kwargs {}: The space provided to batch_space is not a gymnasium Space
    instance": blaming the kwargs, naming no space."""
    expected = f"cannot make env '{M}:{env}': its {which} is None: expected a gymnasium.spaces.Space set in __init__"
    with pytest.raises(EnvBuildError, match=f"^{re.escape(expected)}$"):
        build_vector_env(ServerConfig(env=f"{M}:{env}", num_envs=1))


def test_a_missing_constructor_argument_says_how_to_pass_it() -> None:
    with pytest.raises(
        EnvBuildError, match=re.escape("""; pass constructor arguments with --env-kwargs '{"size": ...}'""")
    ):
        build_vector_env(ServerConfig(env=f"{M}:NeedsArgs", num_envs=1))
    with pytest.raises(
        EnvBuildError,
        match=r"_helper\(\) missing 1 required positional argument: 'b' \(at .*misbehaving_envs\.py:\d+ in __init__\)$",
    ):
        build_vector_env(ServerConfig(env=f"{M}:HelperMissesAnArgument", num_envs=1))  # (no hint: not the env's own)


def test_a_constructor_raising_a_base_exception_cannot_make_the_env() -> None:
    with pytest.raises(EnvBuildError, match=r"^cannot make env .*CancelledError"):
        build_vector_env(ServerConfig(env=f"{M}:BuildCancelled", num_envs=1))


class _Reset(NamedTuple):
    obs: Any
    info: Any


class _NamedTupleAndMappingInfo(gym.Env[Any, Any]):
    """Within gymnasium's API, though no plain tuple and dict: a namedtuple from reset, a read-only mapping as info."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return _Reset(np.zeros(2, np.float32), types.MappingProxyType({"a": 1}))

    def step(self, action: Any) -> Any:
        return np.zeros(2, np.float32), 1.0, False, False, types.MappingProxyType({"a": 2})


def test_a_named_tuple_and_a_mapping_info_are_taken() -> None:
    env = IsolateErrors(_NamedTupleAndMappingInfo(), repeat_on_reset=False)
    assert env.reset(seed=0)[1] == {"a": 1}
    assert env.step(0)[4] == {"a": 2}
