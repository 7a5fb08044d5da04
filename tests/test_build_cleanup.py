"""A build of the envs that fails (an env's constructor raises, in this process or in an async worker) closes the envs
it had made before it raises its error: a server that serves on after a failed --fresh-envs rebuild would otherwise
keep them (a simulator's window, process or GPU context each) until garbage collection. An error of their close is
logged, and the build's own error raised."""

from __future__ import annotations

import functools
import gc
import logging
import signal
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest

from env_server import ServerConfig, build_vector_env, envs
from env_server.envs import EnvBuildError
from tests.closing_envs import LooseBox, OwnSpace, Recorded, records

pytestmark = pytest.mark.timeout(120)

ENV = "tests.closing_envs:Recorded"


def test_a_sync_build_that_fails_closes_the_envs_it_made(tmp_path: Path) -> None:
    record = tmp_path / "record"
    config = ServerConfig(env=ENV, num_envs=3, env_kwargs={"record": str(record), "fail_at": 3})
    with pytest.raises(EnvBuildError, match="build 3 fails"):
        build_vector_env(config)
    found = records(record)
    assert found["made"] == [1, 2] and found["failed"] == [3]
    assert sorted(found["closed"]) == [1, 2]


@pytest.mark.parametrize(
    ("obs_differs_at", "action_differs_at", "words"),
    [(2, 0, "observation spaces are not equivalent"), (3, 2, "action space doesn't make the `single_action_space`")],
)
def test_a_sync_build_whose_envs_spaces_differ_is_refused_in_gymnasiums_words_and_closes_them(
    tmp_path: Path, obs_differs_at: int, action_differs_at: int, words: str
) -> None:
    """The envs' spaces are checked by the server (see envs._observation_mode), not by SyncVectorEnv: the same
    error as SyncVectorEnv's, the first env that differs (its observation space, then its action space) named."""
    kwargs: dict[str, Any] = {"fail_at": 0, "obs_differs_at": obs_differs_at, "action_differs_at": action_differs_at}
    theirs = [functools.partial(Recorded, str(tmp_path / "theirs"), **kwargs) for _ in range(3)]
    with pytest.raises(RuntimeError) as gymnasiums:
        gym.vector.SyncVectorEnv(theirs)
    assert words in str(gymnasiums.value)
    record = tmp_path / "record"
    config = ServerConfig(env=ENV, num_envs=3, env_kwargs={"record": str(record), **kwargs})
    with pytest.raises(EnvBuildError) as ours:
        build_vector_env(config)
    assert str(gymnasiums.value) in str(ours.value), (ours.value, gymnasiums.value)
    found = records(record)
    assert found["made"] == [1, 2, 3] and sorted(found["closed"]) == [1, 2, 3]


def test_a_sync_builds_spaces_are_those_sync_vector_env_makes(tmp_path: Path) -> None:
    record = str(tmp_path / "record")
    config = ServerConfig(env=ENV, num_envs=3, env_kwargs={"record": record, "fail_at": 0})
    vec = build_vector_env(config)
    theirs = gym.vector.SyncVectorEnv([functools.partial(Recorded, record, 0) for _ in range(3)])
    try:
        assert vec.single_observation_space is vec.unwrapped.envs[0].observation_space  # type: ignore[attr-defined]
        assert vec.observation_space == theirs.observation_space
        assert vec.observation_space.low.shape == (3, 2)  # type: ignore[attr-defined]
        assert vec.action_space == theirs.action_space
    finally:
        vec.close()
        theirs.close()


@pytest.mark.parametrize("spaces", ["own", "loose"])
def test_a_sync_build_takes_the_envs_sync_vector_env_takes(tmp_path: Path, spaces: str) -> None:
    """Envs that gymnasium's SyncVectorEnv takes are taken, their spaces its: a space of the env's own (whose shape
    and dtype gymnasium cannot tell: built in the "same" mode, as before), and env 0's Box of a subclass whose own
    ``==`` says the other envs' (other bounds) equal to it (Python asks it first, the subclass's, for ``!=`` too)."""
    kwargs: dict[str, Any] = {"fail_at": 0, "spaces": spaces}
    theirs = gym.vector.SyncVectorEnv(
        [functools.partial(Recorded, str(tmp_path / "theirs"), **kwargs) for _ in range(3)]
    )
    vec = build_vector_env(ServerConfig(env=ENV, num_envs=3, env_kwargs={"record": str(tmp_path / "record"), **kwargs}))
    try:
        assert vec.single_observation_space is vec.unwrapped.envs[0].observation_space  # type: ignore[attr-defined]
        assert type(vec.observation_space) is type(theirs.observation_space)
        assert vec.observation_space == theirs.observation_space
        # (their types differ, or gymnasium cannot tell them: SyncVectorEnv compares the spaces itself, as before)
        assert vec.unwrapped.observation_mode == "same"  # type: ignore[attr-defined]
    finally:
        vec.close()
        theirs.close()


class _WideBox(gym.spaces.Box):
    """A Box subclass with Box's own ``==``: Python asks it first where it is the right operand, and np.allclose's
    tolerance is relative to its second operand (1000 and 1000.01000005: close one way, not the other; ``==``
    says not equal, either way round, the _WideBox's bounds compared with the Box's)."""


def _batch_cases() -> list[gym.Space[Any]]:
    """Spaces to batch: Boxes of one low and one high value (which envs._batched makes from those values), and
    others (which it leaves to batch_space): per-element bounds, in their last element past the first part
    compared, bool, np.longdouble, a Box subclass, a Dict."""
    big = np.zeros(envs._COMPARED_AT_ONCE + 5, np.float32)
    big_late = big.copy()
    big_late[-1] = -1.0
    return [
        gym.spaces.Box(0, 255, (4, 3, 2), np.uint8),
        gym.spaces.Box(-np.inf, np.inf, (5,), np.float32),
        gym.spaces.Box(-0.0, 0.0, (2,), np.float64),
        gym.spaces.Box(-np.inf, 7, (2, 2), np.int64),  # (an integer Box unbounded below: batched, it is bounded)
        gym.spaces.Box(-128, 127, (3,), np.int8),
        gym.spaces.Box(-1.5, 2.5, (2, 3), np.float16),
        gym.spaces.Box(0.0, 1.0, (), np.float64),
        gym.spaces.Box(big, big + 1),  # (one value, over more than one part)
        gym.spaces.Box(0.0, 1.0, (0, 3), np.float32),  # (batch_space's: no value)
        gym.spaces.Box(big_late, big + 1),  # (batch_space's)
        gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 1.0], np.float32)),  # (batch_space's)
        gym.spaces.Box(0, 1, (3,), cast(Any, np.bool_)),  # (batch_space's)
        # (batch_space's: float128 on x86-64 Linux, 16 bytes an element, which no unsigned integer views bit for bit;
        # the wire cannot carry it, and the server says so, where it failed to build with "data type 'u16' not
        # understood")
        gym.spaces.Box(0.0, 1.0, (2,), np.longdouble),
        _WideBox(0.0, 1.0, (2,)),  # (batch_space's: a subclass)
        gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (2,))}),  # (batch_space's)
    ]


@pytest.mark.parametrize("case", range(len(_batch_cases())))
def test_the_batched_space_is_gymnasiums(case: int) -> None:
    """envs._batched makes a Box of one low and one high value from those values: the same Box as gymnasium's
    batch_space makes, its arrays alike (values, dtype, layout), its other attributes equal, seeded alike."""
    space = _batch_cases()[case]
    space.seed(7)
    ours, theirs = envs._batched(space, 3), gym.vector.utils.batch_space(space, 3)
    assert type(ours) is type(theirs) and ours == theirs and str(ours) == str(theirs)
    assert vars(ours).keys() == vars(theirs).keys()
    assert ours.np_random.bit_generator.state == theirs.np_random.bit_generator.state
    if isinstance(ours, gym.spaces.Box) and isinstance(theirs, gym.spaces.Box):
        for name, mine in vars(ours).items():
            gyms = vars(theirs)[name]
            if not isinstance(mine, np.ndarray):
                assert name == "_np_random" or mine == gyms, name
                continue
            assert mine.dtype == gyms.dtype and mine.shape == gyms.shape, name
            assert mine.tobytes() == gyms.tobytes() and mine.strides == gyms.strides, name
            assert mine.flags.writeable == gyms.flags.writeable and mine.flags.owndata == gyms.flags.owndata, name
        if ours.dtype != np.longdouble:  # (which gymnasium's Box cannot sample: numpy draws no float128)
            assert np.array_equal(ours.sample(), theirs.sample())


def _spaces() -> list[gym.Space[Any]]:
    """Spaces some pairs of which gymnasium's == says are equal, others not (tolerance, dtype, shape, keys...)."""
    big = np.zeros(envs._COMPARED_AT_ONCE * 2 + 5, np.float32)
    big_late = big.copy()
    big_late[-1] = 1.0
    return [
        gym.spaces.Box(0, 255, (4, 3), np.uint8),
        gym.spaces.Box(0, 255, (4, 3), np.uint8),
        gym.spaces.Box(0, 254, (4, 3), np.uint8),
        gym.spaces.Box(0, 255, (3, 4), np.uint8),
        gym.spaces.Box(0, 255, (4, 3), np.int16),
        gym.spaces.Box(-1.0, 1.0, (3,), np.float64),
        gym.spaces.Box(-1.0, 1.0 + 1e-9, (3,), np.float64),  # (within allclose's tolerance: equal)
        gym.spaces.Box(-1.0, 1.001, (3,), np.float64),
        gym.spaces.Box(-np.inf, np.inf, (3,), np.float64),
        gym.spaces.Box(big, big + 1),
        gym.spaces.Box(big_late, big + 1),
        gym.spaces.Box(np.zeros(0, np.float32), np.zeros(0, np.float32)),
        gym.spaces.Discrete(3),
        gym.spaces.Discrete(3, start=1),
        gym.spaces.Discrete(3, dtype=np.int32),
        gym.spaces.MultiDiscrete([2, 3]),
        gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (2,)), "b": gym.spaces.Discrete(2)}),
        gym.spaces.Dict({"b": gym.spaces.Discrete(2), "a": gym.spaces.Box(0, 1, (2,))}),
        gym.spaces.Dict({"a": gym.spaces.Box(0, 2, (2,)), "b": gym.spaces.Discrete(2)}),
        gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (2,))}),
        gym.spaces.Dict(OrderedDict([("b", gym.spaces.Discrete(2)), ("a", gym.spaces.Box(0, 1, (2,)))])),
        gym.spaces.Tuple((gym.spaces.Box(0, 1, (2,)), gym.spaces.Discrete(2))),
        gym.spaces.Tuple((gym.spaces.Box(0, 1, (2,)), gym.spaces.Discrete(3))),
        gym.spaces.Tuple((gym.spaces.Box(0, 1, (2,)),)),
        gym.spaces.Box(0.0, 1000.0, (2,), np.float64),
        _WideBox(0.0, 1000.01000005, (2,), np.float64),
        _WideBox(0.0, 1000.0, (2,), np.float64),
        LooseBox(0, 255, (4, 3), np.uint8),
        LooseBox(-1.0, 1.0, (3,), np.float64),
        gym.spaces.Dict({"a": LooseBox(0, 7, (2,)), "b": gym.spaces.Discrete(2)}),
        gym.spaces.Tuple((LooseBox(0, 7, (2,)), gym.spaces.Discrete(2))),
        OwnSpace(),
    ]


def test_the_build_compares_spaces_as_gymnasiums_eq_does() -> None:
    """_same_space says what ``==`` says, _space_differs what ``!=`` says (SyncVectorEnv's test), of every pair,
    either way round: Box subclasses too, with Box's ``==`` or their own."""
    spaces, again = _spaces(), _spaces()
    box, wide = spaces[-8], spaces[-7]  # (see _WideBox)
    assert isinstance(box, gym.spaces.Box) and isinstance(wide, _WideBox)
    assert np.allclose(box.high, wide.high) and not np.allclose(wide.high, box.high) and box != wide != box
    for space in spaces:
        for other in spaces + again:
            assert envs._same_space(space, other) == (space == other), (space, other)
            assert envs._space_differs(space, other) == (space != other), (space, other)


def test_a_close_that_raises_is_logged_and_the_build_error_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record = tmp_path / "record"
    kwargs = {"record": str(record), "fail_at": 3, "close_fails": True}
    with (
        caplog.at_level(logging.WARNING, logger="env_server.envs"),
        pytest.raises(EnvBuildError, match="build 3 fails"),
    ):
        build_vector_env(ServerConfig(env=ENV, num_envs=3, env_kwargs=kwargs))
    assert sorted(records(record)["closed"]) == [1, 2]  # (each close tried, the first's error notwithstanding)
    closes = [r.getMessage() for r in caplog.records if "could not be closed" in r.getMessage()]
    assert len(closes) == 2, caplog.text
    assert "OSError: env 1 cannot close" in closes[0] and "OSError: env 2 cannot close" in closes[1]


def test_an_async_build_whose_worker_fails_closes_the_other_workers_envs(tmp_path: Path) -> None:
    record = tmp_path / "record"
    # Builds 1 and 2 in this process (the env built first, to check it; gymnasium's own, for the spaces): each
    # closed at once; 3 to 5 in the workers, the last of them failing.
    config = ServerConfig(env=ENV, num_envs=3, env_kwargs={"record": str(record), "fail_at": 5}, vectorization="async")
    with pytest.raises(EnvBuildError):
        build_vector_env(config)
    found = records(record)
    assert found["made"] == [1, 2, 3, 4] and found["failed"] == [5]
    assert sorted(found["closed"]) == [1, 2, 3, 4]  # (3 and 4 in their workers, before they ended)


@pytest.mark.parametrize(
    ("kwargs", "how"), [({"code": 3}, "exit code 3"), ({"signal_number": signal.SIGKILL}, "killed by SIGKILL")]
)
def test_an_async_worker_that_ends_with_no_error_to_report_is_named(kwargs: dict[str, int], how: str) -> None:
    """Its pipe's BrokenPipeError or EOFError, which the start raises, says nothing of why."""
    config = ServerConfig(env="tests.envs:EndsInWorkerEnv", num_envs=2, env_kwargs=kwargs, vectorization="async")
    with pytest.raises(EnvBuildError, match=rf"worker process [12] of 2 ended \({how}: .+\) as it made its env"):
        build_vector_env(config)


def test_a_start_whose_workers_ended_before_its_first_command_leaves_no_view_for_the_garbage_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start's first commands (gymnasium's check of the workers' spaces, the last step of its constructor) sent to
    workers that had ended already: sent as gymnasium sends them, a view of a BytesIO, left in the traceback of the
    build's error, was garbage in a reference cycle, whose collection crashed the process on Python 3.12.1 (SIGSEGV,
    CPython's gh-111049: a test process of this suite, under load) and printed "Exception ignored ... BufferError" on
    3.13.0. The workers are waited for here so that the sends meet closed pipes (under load they did by chance)."""
    check = gym.vector.AsyncVectorEnv._check_spaces

    def after_the_workers_ended(self: gym.vector.AsyncVectorEnv) -> None:
        for process in self.processes:
            process.join(timeout=60)
        check(self)

    monkeypatch.setattr(gym.vector.AsyncVectorEnv, "_check_spaces", after_the_workers_ended)
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: unraisable.append(repr(raised.exc_value)))
    config = ServerConfig(env="tests.envs:EndsInWorkerEnv", num_envs=2, env_kwargs={"code": 3}, vectorization="async")
    with pytest.raises(EnvBuildError, match="ended"):
        build_vector_env(config)
    gc.collect()
    assert unraisable == []


def test_an_async_workers_error_that_does_not_unpickle_is_said_as_its_text() -> None:
    """It pickled, so it was put on the queue as it was; reading it back raised a TypeError of its __init__, which
    escaped the failed start's clean-up and was said as the constructor's own error ("missing 1 required
    positional argument")."""
    config = ServerConfig(
        env="tests.envs:EndsInWorkerEnv", num_envs=2, env_kwargs={"unreadable": True}, vectorization="async"
    )
    with pytest.raises(EnvBuildError, match="_TwoArgumentError: simulator: licence not found"):
        build_vector_env(config)
