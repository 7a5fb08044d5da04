"""A build of the envs that fails (an env's constructor raises, in this process or in an async worker) closes the envs
it had made before it raises its error: a server that serves on after a failed --fresh-envs rebuild would otherwise
keep them (a simulator's window, process or GPU context each) until garbage collection. An error of their close is
logged, and the build's own error raised."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from env_server import ServerConfig, build_vector_env
from env_server.envs import EnvBuildError
from tests.closing_envs import records

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


def test_an_async_workers_error_that_does_not_unpickle_is_said_as_its_text() -> None:
    """It pickled, so it was put on the queue as it was; reading it back raised a TypeError of its __init__, which
    escaped the failed start's clean-up and was said as the constructor's own error ("missing 1 required
    positional argument")."""
    config = ServerConfig(
        env="tests.envs:EndsInWorkerEnv", num_envs=2, env_kwargs={"unreadable": True}, vectorization="async"
    )
    with pytest.raises(EnvBuildError, match="_TwoArgumentError: simulator: licence not found"):
        build_vector_env(config)
