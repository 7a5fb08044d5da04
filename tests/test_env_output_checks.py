"""An env's output that gymnasium's vector envs cannot store or stack gets an error naming the env, what was
expected and what came, and the server serves on: a float observation of a Discrete space, a None observation,
a reward that is no number (a 1-element array, 10**400, a complex, None), a flag that is no bool; an observation
that does not fit stops a fault-tolerant fleet at once, as a NaN one does, instead of a minute of reconnects."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from env_server import ServerConfig, build_vector_env
from env_server.envs import ObservationLayoutError, misfit_message
from env_server.health import check
from env_server.isolation import ENV_ERROR_KEY
from learner import EnvCrashedError, RemoteVectorEnv
from tests.conftest import SpawnServer

ENV = "tests.output_envs:OutputEnv"
# gymnasium's AsyncVectorEnv says a worker's error, which these tests make on purpose, as three "ERROR:" warnings
# before it raises it (env-server drops two of them from its log; here they would fill pytest's summary)
pytestmark = pytest.mark.filterwarnings("ignore:.*ERROR:UserWarning:gymnasium.vector.async_vector_env")
BOX = r"Box\(-1\.0, 1\.0, \(2,\), float32\)"


@contextlib.contextmanager
def vector_env(
    num_envs: int = 3, vectorization: str = "sync", in_process: bool = False, **kwargs: Any
) -> Iterator[Any]:
    """A server's vector env (``in_process``: a learner's, --backend gym) of ``num_envs`` OutputEnv(``**kwargs``)."""
    config = ServerConfig(env=ENV, num_envs=num_envs, env_kwargs=kwargs, vectorization=vectorization)
    envs = build_vector_env(config, in_process=in_process)
    try:
        yield envs
    finally:
        envs.close()


def steps(envs: Any, n: int) -> tuple[Any, ...]:
    """``n`` steps of action 0; the last one's results."""
    for _ in range(n):
        result = envs.step(np.zeros(envs.num_envs, dtype=np.int64))
    return result


# ---- observations (env_server/envs.py): named where gymnasium's stacking fails -----------------------------------


VECTORIZATIONS = pytest.mark.parametrize("vectorization", ["sync", "async"])


@VECTORIZATIONS
@pytest.mark.parametrize(("obs", "dtype"), [("float", "float"), ("np_float", "float64"), ("float_array", "float64")])
def test_a_float_observation_of_a_discrete_space_is_named_with_its_env(
    obs: str, dtype: str, vectorization: str
) -> None:
    """gymnasium stacks with casting="same_kind", which refuses it ("Cannot cast array data from dtype('float64')
    to dtype('int64')", naming nothing); an unsafe conversion (np.asarray(obs, dtype=int64)) takes it, so the
    misfit went unnamed. Async vectorization's write into the shared memory made that conversion: the
    observation was cast without a word (CheckWrittenObservations)."""
    with vector_env(obs=obs, discrete=True, vectorization=vectorization) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        named = (
            rf"^the server's env 1: its step returned an observation of dtype {dtype}, which gymnasium's vector envs "
            r"do not cast to the observation space's int64 \(they cast within a kind only: not float to int, say\) "
            r"\(Discrete\(3\)\)$"
        )
        with pytest.raises(ObservationLayoutError, match=named) as raised:
            steps(envs, 1)
        assert raised.value.env_index == 1


@pytest.mark.parametrize(
    ("obs", "discrete"),
    [
        ("int", True),
        ("np_int", True),
        ("bool", True),
        ("float64", False),
        ("python_ints", False),
        ("python_floats", False),
        ("int_array", False),
    ],
)
@VECTORIZATIONS
def test_observations_gymnasium_casts_are_fine(obs: str, discrete: bool, vectorization: str) -> None:
    """Python ints and bools into a Discrete space, float64 and ints into a float32 Box: gymnasium's same-kind
    cast takes them, and so does the check."""
    with vector_env(obs=obs, discrete=discrete, at=1, vectorization=vectorization) as envs:
        space = envs.single_observation_space
        envs.reset(seed=0)
        steps(envs, 3)
        from tests.output_envs import OBSERVATIONS

        assert misfit_message(OBSERVATIONS[obs](), space, 1, "step") is None


@VECTORIZATIONS
@pytest.mark.parametrize("discrete", [False, True])
def test_a_none_observation_is_named_with_its_env(discrete: bool, vectorization: str) -> None:
    """None was read as "no observation yet": numpy's "Output array has wrong dimensionality", or a TypeError
    (async vectorization's write into the shared memory: NaN in a float space, without a word)."""
    space = r"Discrete\(3\)" if discrete else BOX
    with vector_env(obs="none", discrete=discrete, vectorization=vectorization) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        named = rf"^the server's env 1: its step returned None, not an observation \(observation space {space}\)$"
        with pytest.raises(ObservationLayoutError, match=named):
            steps(envs, 1)


@VECTORIZATIONS
def test_an_observation_of_another_shape_with_as_many_values_is_named(vectorization: str) -> None:
    """Async vectorization's write into the shared memory flattens it: a (2, 1) array went in as a (2,) one."""
    with vector_env(obs="column", vectorization=vectorization) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        named = r"^the server's env 1: its step returned an observation of shape \(2, 1\) and dtype float32, not the"
        with pytest.raises(ObservationLayoutError, match=named):
            steps(envs, 1)


@VECTORIZATIONS
def test_a_complex_observation_of_a_float_box_is_named(vectorization: str) -> None:
    with vector_env(obs="complex", vectorization=vectorization) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        with pytest.raises(ObservationLayoutError, match=r"^the server's env 1: its step returned an observation of "):
            steps(envs, 1)


def test_in_process_envs_are_named_as_such_not_as_a_servers() -> None:
    """--backend gym: no server runs, so not "the server's env 1"."""
    with vector_env(obs="shape3", in_process=True) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        with pytest.raises(
            ObservationLayoutError, match=r"^in-process env 1: its step returned an observation of shape \(3,\)"
        ):
            steps(envs, 1)
    # (the check of the first observations too)
    with vector_env(obs="shape3", at=0, in_process=True) as envs, pytest.raises(ObservationLayoutError) as raised:
        envs.reset(seed=0)
    assert str(raised.value).endswith("(in-process env 1)"), raised.value


def test_the_gym_backend_names_its_envs_in_process() -> None:
    from learner.envs import FleetSpec, open_fleet

    spec = FleetSpec(
        env=ENV, backend="gym", num_servers=1, envs_per_server=2, env_kwargs={"obs": "float", "discrete": True}
    )
    with open_fleet(spec) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        with pytest.raises(
            ObservationLayoutError, match=r"^in-process env 1: its step returned an observation of dtype float"
        ):
            steps(envs, 1)


# ---- rewards and flags (env_server/isolation.py): the env's own error, named ----------------------------------------

BAD_REWARDS = {
    "one_element": r"reward of type ndarray, shape \(1,\), dtype float64: expected a number \(a float\)",
    "two_elements": r"reward of type ndarray, shape \(2,\), dtype float64: expected a number \(a float\)",
    "huge_int": r"reward 1000000000000000000000000000000000000\.\.\. of type int, which does not fit a float64",
    "complex": r"reward \(1\+1j\) of type complex: expected a number \(a float\)",
    "none": r"reward None: expected a number \(a float\)",
    "str": r"reward '1\.0' of type str: expected a number \(a float\)",
    "list": r"reward \[1\.0\] of type list: expected a number \(a float\)",
}


def assert_env_1_erred(result: tuple[Any, ...], text: str) -> None:
    """Env 1 of 3, and only it, has ``env_error`` ``step: TypeError: step() returned <text>``, its episode cut
    (truncated, reward 0); the others stepped as usual."""
    _, rewards, terminations, truncations, infos = result
    assert infos["_" + ENV_ERROR_KEY].tolist() == [False, True, False], infos
    assert re.fullmatch(rf"step: TypeError: step\(\) returned {text}", infos[ENV_ERROR_KEY][1]), infos[ENV_ERROR_KEY][1]
    assert rewards.tolist() == [1.0, 0.0, 1.0]
    assert truncations.tolist() == [False, True, False] and not terminations.any()


@pytest.mark.parametrize("reward", BAD_REWARDS)
def test_a_reward_a_vector_env_cannot_store_is_that_envs_named_error(reward: str) -> None:
    """Not gymnasium's "setting an array element with a sequence" (or an OverflowError, a TypeError) failing the
    whole batch, nor None stored as NaN and "1.0" as 1.0 without a word."""
    with vector_env(reward=reward) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        assert_env_1_erred(steps(envs, 1), BAD_REWARDS[reward])
        steps(envs, 2)  # (the env goes on: reset, and erring again at each step)


BAD_FLAGS = {
    "none": "None",
    "nan": "nan of type float",
    "two": "2 of type int",
    "one_element": r"of type ndarray, shape \(1,\), dtype bool",
    "str": "'yes' of type str",
    "float": r"1\.0 of type float",
}


@pytest.mark.parametrize("flag", BAD_FLAGS)
@pytest.mark.parametrize("which", ["terminated", "truncated"])
def test_a_flag_that_is_no_bool_is_that_envs_named_error(flag: str, which: str) -> None:
    """gymnasium would store None as False, NaN and 2 as True."""
    kwargs: dict[str, Any] = {which: flag}
    with vector_env(**kwargs) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        assert_env_1_erred(steps(envs, 1), rf"{which} {BAD_FLAGS[flag]}: expected a bool")


GOOD_REWARDS = {
    "float": 0.5,
    "np_float32": 0.5,
    "zero_d": 0.5,
    "zero_d_int": 3.0,
    "int": 3.0,
    "np_int": -3.0,
    "bool": 1.0,
    "np_bool": 1.0,
    "big_int": float(2**70),
    "inf": float("inf"),
}


@pytest.mark.parametrize("reward", GOOD_REWARDS)
def test_rewards_that_are_numbers_pass(reward: str) -> None:
    with vector_env(reward=reward, at=1) as envs:
        envs.reset(seed=0)
        _, rewards, _, _, infos = steps(envs, 2)
        assert ENV_ERROR_KEY not in infos
        assert rewards.tolist() == [1.0, GOOD_REWARDS[reward], 1.0]


def test_a_nan_reward_is_the_learners_to_name() -> None:
    with vector_env(reward="nan", at=1) as envs:
        envs.reset(seed=0)
        _, rewards, _, _, infos = steps(envs, 1)
        assert ENV_ERROR_KEY not in infos and np.isnan(rewards[1])


@pytest.mark.parametrize(
    ("flag", "value"),
    [("true", True), ("np_bool", True), ("zero_d", True), ("one", True), ("zero", False), ("np_int", True)],
)
def test_bools_and_ints_0_and_1_are_flags(flag: str, value: bool) -> None:
    with vector_env(terminated=flag, truncated=flag, at=1) as envs:
        envs.reset(seed=0)
        _, _, terminations, truncations, infos = steps(envs, 1)
        assert ENV_ERROR_KEY not in infos
        assert terminations.tolist() == truncations.tolist() == [False, value, False]


def test_a_long_double_beyond_a_float64_does_not_fit() -> None:
    from env_server.isolation import _check_reward

    if np.finfo(np.longdouble).max <= np.finfo(np.float64).max:
        pytest.skip("this platform's long double is a float64")
    with pytest.raises(TypeError, match=r"reward np\.longdouble\('1e\+400'\) of type longdouble, which does not fit"):
        _check_reward(np.longdouble("1e400"))
    _check_reward(np.longdouble("1e300"))
    _check_reward(np.longdouble("inf"))  # (infinite: the learner's to name)


def test_the_gym_backend_checks_rewards_too() -> None:
    """learner train --backend gym steps the same envs in-process: the env's named error, not "learner train: error:
    setting an array element with a sequence." and nothing else."""
    from learner.envs import FleetSpec, open_fleet

    spec = FleetSpec(env=ENV, backend="gym", num_servers=1, envs_per_server=3, env_kwargs={"reward": "one_element"})
    with open_fleet(spec) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        assert_env_1_erred(steps(envs, 1), BAD_REWARDS["one_element"])


def test_async_workers_check_rewards_too() -> None:
    with vector_env(reward="huge_int", vectorization="async") as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        assert_env_1_erred(steps(envs, 1), BAD_REWARDS["huge_int"])


def test_a_server_reports_a_bad_reward_as_that_envs_error_and_serves_on(spawn_server: SpawnServer) -> None:
    """The server failed all its envs ("the env raised in step: ValueError: setting an array element with a
    sequence"), its own message for rewards that are not numbers out of reach."""
    server = spawn_server(ENV, 3, "--env-kwargs", json.dumps({"reward": "one_element"}))
    with RemoteVectorEnv([server.address], fault_tolerant=True) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        _, rewards, _, truncations, infos = steps(envs, 1)
        assert infos["_" + ENV_ERROR_KEY].tolist() == [False, True, False]
        assert BAD_REWARDS["one_element"].replace("\\", "") in infos[ENV_ERROR_KEY][1]
        assert rewards.tolist() == [1.0, 0.0, 1.0] and truncations[1]
        steps(envs, 3)
    assert check(server.address) == "SERVING"
    assert "Traceback" not in server.logs()  # (the check's own error: the line says it all)


# ---- a misfit stops a fault-tolerant fleet at once (learner/remote.py) ------------------------------------------------


@pytest.mark.parametrize("method", ["step", "reset"])
def test_a_fault_tolerant_fleet_raises_an_observation_that_does_not_fit_at_once(
    spawn_server: SpawnServer, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a lost server, reconnected and reset (whose observations do not fit either) for give_up_after (a
    minute: ~40 warnings), then the same error: the env's, named, raised at once as a NaN observation is."""
    kwargs = {"obs": "float", "discrete": True, "at": 0 if method == "reset" else 2}
    server = spawn_server(ENV, 3, "--env-kwargs", json.dumps(kwargs))
    named = (
        rf"\[INTERNAL\]: the env returned in {method} what does not fit: ObservationLayoutError: the server's env 1: "
        rf"its {method} returned"
    )
    with RemoteVectorEnv([server.address], fault_tolerant=True, give_up_after=30) as envs:
        start = time.monotonic()
        if method == "step":
            envs.reset(seed=0)
            steps(envs, 1)
        with pytest.raises(EnvCrashedError, match=named) as raised:
            if method == "reset":
                envs.reset(seed=0)
            steps(envs, 1)
        assert time.monotonic() - start < 10
        assert envs.fault_stats().failures == 0
    assert raised.value.env_index == 1
    assert "lost" not in caplog.text
    assert check(server.address) == "SERVING"


@pytest.mark.slow
@pytest.mark.parametrize("fault_tolerant", [True, False])
@pytest.mark.needs_torch
def test_learner_train_stops_at_once_on_an_observation_that_does_not_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault_tolerant: bool
) -> None:
    """The default run (local env servers, fault-tolerant) stopped after ~60 s of retried resets and ~40 warnings;
    with --no-fault-tolerant it dropped two rollouts first, each ending in the same error."""
    from learner.config import Args
    from learner.train import train
    from tests.conftest import QUIET

    args = Args(
        env=ENV,
        env_kwargs={"obs": "shape3", "bad_seed": -1, "at": 20},
        num_servers=1,
        envs_per_server=2,
        num_steps=16,
        total_timesteps=256,
        run_dir=str(tmp_path / "run"),
        fault_tolerant=fault_tolerant,
        **QUIET,
    )
    start = time.monotonic()
    with pytest.raises(
        EnvCrashedError,
        match=r"ObservationLayoutError: the server's env \d: its step returned an observation of shape \(3,\)",
    ):
        train(args)
    assert time.monotonic() - start < 30
    assert "dropping this rollout" not in caplog.text


@pytest.mark.slow
def test_a_server_back_whose_reset_does_not_fit_stops_a_fault_tolerant_fleet_at_once(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server lost, then back (a new process at its address) with envs whose reset returns an observation that
    does not fit: the reconnect's reset returned the misfit, and was tried again for give_up_after (a minute of
    warnings) though every try would return it; now the fleet raises it on the step that would take the server
    back."""
    server = spawn_server(ENV, 2)
    with RemoteVectorEnv([server.address], fault_tolerant=True, give_up_after=60) as envs:
        envs.reset(seed=0)
        steps(envs, 1)
        server.kill()
        server.argv += ["--env-kwargs", json.dumps({"obs": "shape3", "bad_seed": -1, "at": 0})]
        server.start()
        start = time.monotonic()
        named = r"ObservationLayoutError: env '[^']+', reset\(\): observation has shape \(3,\), expected \(2,\)"
        with pytest.raises(EnvCrashedError, match=named):
            while time.monotonic() - start < 50:
                steps(envs, 1)
        assert time.monotonic() - start < 30
    assert "still down" not in caplog.text
