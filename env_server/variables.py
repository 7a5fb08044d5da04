"""The ``ENVFLEET_*`` environment variables envfleet reads, and a warning for each set one nothing reads.

env-server's own variables come from its parser (one per option: ``env_server.__main__.server_variables``).
The ones only other commands read (the learner, the health probe, docker-compose.yml and the images'
builds) are listed here, once: tests/test_variables.py fails when the code reads one this list lacks.
A misnamed variable would otherwise be ignored in silence (a typo of ``ENVFLEET_TLS_CLIENT_CA`` serves
without mutual TLS), as would one of an option an older server does not have.

No grpc, no torch: env-server's command line imports this before anything imports grpc.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

__all__ = ["OTHER_VARIABLES", "PREFIX", "unread_variables"]

PREFIX = "ENVFLEET_"

OTHER_VARIABLES: Mapping[str, str] = {
    # variable: what reads it (not an env-server option; those have a variable each)
    "ENVFLEET_TLS_CA": "learner; env-server's health probe",
    "ENVFLEET_TLS_SERVER_NAME": "learner; env-server's health probe",
    "ENVFLEET_TLS_CLIENT_CERT": "learner; env-server's health probe",
    "ENVFLEET_TLS_CLIENT_KEY": "learner; env-server's health probe",
    "ENVFLEET_TRACK": "learner train",
    "ENVFLEET_BIND": "docker-compose.yml",
    "ENVFLEET_CPUS": "docker-compose.yml",
    "ENVFLEET_ENV_IMAGE": "docker-compose.yml",
    "ENVFLEET_GID": "docker-compose.yml",
    "ENVFLEET_LEARNER_EXTRAS": "docker-compose.yml (the learner image's build)",
    "ENVFLEET_LEARNER_IMAGE": "docker-compose.yml",
    "ENVFLEET_MEMORY": "docker-compose.yml",
    "ENVFLEET_MEMORY_LIMIT": "docker-compose.yml",
    "ENVFLEET_REPLICAS": "docker-compose.yml",
    "ENVFLEET_RUNS": "docker-compose.yml",
    "ENVFLEET_STOP_AT_RETURN": "docker-compose.yml",
    "ENVFLEET_STOP_GRACE_PERIOD": "docker-compose.yml",
    "ENVFLEET_TORCH_FROM": "docker-compose.yml (the learner image's build)",
    "ENVFLEET_TORCH_INDEX_URL": "docker-compose.yml (the learner image's build)",
    "ENVFLEET_TOTAL_TIMESTEPS": "docker-compose.yml",
    "ENVFLEET_UID": "docker-compose.yml",
}
"""The ``ENVFLEET_*`` variables that no env-server option reads, and what reads each."""


def unread_variables(environ: Mapping[str, str], own: Collection[str]) -> list[str]:
    """A warning for each ``ENVFLEET_*`` variable set in ``environ`` that no envfleet command reads,
    sorted by name; ``own``: the variables of the command that asks (env-server's: one per option),
    :data:`OTHER_VARIABLES` the rest. Names only, never values (a token may be one). A close match of a
    known variable is suggested (compared without the prefix, which every one shares)."""
    known = {name.removeprefix(PREFIX): name for name in (*own, *OTHER_VARIABLES)}
    warnings = []
    for name in sorted(environ):
        if not name.startswith(PREFIX) or name in known.values():
            continue
        close = difflib.get_close_matches(name.removeprefix(PREFIX), known, n=1)
        hint = f"did you mean {known[close[0]]}?" if close else "a typo, or an option of a newer envfleet?"
        warnings.append(f"{name} is set, but no envfleet option reads it: ignored ({hint})")
    return warnings
