"""The ENVFLEET_* variables envfleet reads come from one place (env-server's parser, and
env_server.variables.OTHER_VARIABLES for the rest), and a set one that none reads is warned of."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from env_server.__main__ import build_parser, server_variables
from env_server.variables import OTHER_VARIABLES, unread_variables

REPO = Path(__file__).resolve().parent.parent
# (a name: ENVFLEET_ and words of capitals and digits; not ENVFLEET_{...} or ENVFLEET_* in a message)
NAME = re.compile(r"\bENVFLEET_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")


def _sources() -> list[Path]:
    """What reads ENVFLEET_* variables: the packages' code, the images, the compose file, the k8s manifests
    (not the list itself)."""
    files = [*REPO.glob("env_server/**/*.py"), *REPO.glob("learner/**/*.py"), *REPO.glob("Dockerfile*")]
    files += [*REPO.glob("docker-compose*.yml"), *(p for p in REPO.glob("k8s/**/*") if p.is_file())]
    return sorted(p for p in files if p != REPO / "env_server" / "variables.py")


def _named() -> dict[str, set[str]]:
    """Each ENVFLEET_* name the sources hold -> the files that hold it."""
    named: dict[str, set[str]] = {}
    for path in _sources():
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            named.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return named


def test_every_variable_the_code_reads_is_known() -> None:
    """A variable the code reads but the list lacks would be warned of as read by nothing."""
    named = _named()
    assert {"ENVFLEET_TRACK", "ENVFLEET_TLS_CLIENT_CA", "ENVFLEET_REPLICAS"} <= named.keys()  # (the grep finds them)
    known = server_variables() | OTHER_VARIABLES.keys()
    unknown = {name: sorted(files) for name, files in named.items() if name not in known}
    assert not unknown, f"read, but neither an env-server option nor in env_server.variables.OTHER_VARIABLES: {unknown}"


def test_the_list_holds_each_other_variable_once_and_none_that_nothing_reads() -> None:
    named = _named()
    assert not OTHER_VARIABLES.keys() & server_variables()  # (env-server's own come from its parser)
    stale = sorted(OTHER_VARIABLES.keys() - named.keys())
    assert not stale, f"in env_server.variables.OTHER_VARIABLES, but nothing reads them: {stale}"


def test_server_variables_are_the_ones_that_set_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each option's default comes from its variable, but for those that take none (--help, --version,
    --parent-pid)."""
    for action in build_parser()._actions:
        monkeypatch.setenv(f"ENVFLEET_{action.dest.upper()}", "s3ntinel")
    read = {f"ENVFLEET_{action.dest.upper()}" for action in build_parser()._actions if action.default == "s3ntinel"}
    assert read == server_variables()
    assert "ENVFLEET_PARENT_PID" not in read and "ENVFLEET_HELP" not in read


def test_a_variable_none_reads_is_warned_of_once_sorted_with_a_close_match() -> None:
    environ = {
        "ENVFLEET_TLS_CLIENT_CAS": "/x",  # (a typo: the server would serve without mutual TLS)
        "ENVFLEET_ZZZ_NEW_OPTION": "s3cret",
        "ENVFLEET_NUMENVS": "4",
        "ENVFLEET_NUM_ENVS": "4",  # env-server's
        "ENVFLEET_TRACK": "on",  # the learner's
        "ENVFLEET_TLS_CA": "/ca.crt",  # the health probe's and the learner's
        "ENVFLEET_REPLICAS": "3",  # docker-compose.yml's
        "PATH": "/bin",
    }
    assert unread_variables(environ, server_variables()) == [
        "ENVFLEET_NUMENVS is set, but no envfleet option reads it: ignored (did you mean ENVFLEET_NUM_ENVS?)",
        "ENVFLEET_TLS_CLIENT_CAS is set, but no envfleet option reads it: ignored "
        "(did you mean ENVFLEET_TLS_CLIENT_CA?)",
        "ENVFLEET_ZZZ_NEW_OPTION is set, but no envfleet option reads it: ignored "
        "(a typo, or an option of a newer envfleet?)",
    ]  # (names only: never a value, which may be a secret)
    assert unread_variables({"ENVFLEET_TLS_CAA": ""}, server_variables()) == [
        "ENVFLEET_TLS_CAA is set, but no envfleet option reads it: ignored (did you mean ENVFLEET_TLS_CA?)"
    ]


def test_a_learner_command_warns_of_a_set_variable_no_envfleet_command_reads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As env-server does: a typo of a variable the learner reads (ENVFLEET_TLS_CA) is said, not ignored."""
    from learner.cli import main

    for name in [n for n in os.environ if n.startswith("ENVFLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ENVFLEET_TLS_CAA", "/ca.crt")
    monkeypatch.setenv("ENVFLEET_TLS_CA", "/ca.crt")  # (the learner's own: not warned of)
    assert main(["plot", str(tmp_path / "none")]) == 1
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "is set" in r.getMessage()] == [
        ("WARNING", "ENVFLEET_TLS_CAA is set, but no envfleet option reads it: ignored (did you mean ENVFLEET_TLS_CA?)")
    ]
