"""What a run's envs were beyond their id and spaces (``served``: their wrappers, time limit and env kwargs, in
its checkpoints and config.json), told apart from those of running servers it is evaluated or resumed on."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["given_kwargs_differ", "other_task"]


def other_task(served: dict[str, Any], envs: Any) -> list[str]:
    """How running servers make their envs (``envs``, theirs) otherwise than the run's (``served``: what its envs
    said, checkpoints since EnvSpec.env_kwargs): the same id and spaces, another task (FrozenLake's is_slippery;
    a time limit the policy never met, or none, where an episode may never end; a wrapper that leaves the
    spaces as they are), each as "env kwargs {...} (the run's: {...})"; empty where nothing differs. Compared
    only where both said their env kwargs (servers and runs older than EnvSpec.env_kwargs may have said no time
    limit whatever it was: async servers said 0, and no wrappers), and the time limit only where the servers'
    spec was read."""
    kwargs, spec = getattr(envs, "env_kwargs", None), getattr(envs, "spec", None)
    if kwargs is None or served.get("env_kwargs") is None:
        return []
    differ = []
    wrappers, run_wrappers = getattr(envs, "wrappers", None), served.get("wrappers")
    if wrappers is not None and run_wrappers is not None and list(wrappers) != list(run_wrappers):
        differ.append(f"wrappers {','.join(wrappers) or 'none'} (the run's: {','.join(run_wrappers) or 'none'})")
    if kwargs != served["env_kwargs"]:
        now, then = (json.dumps(value, sort_keys=True) for value in (kwargs, served["env_kwargs"]))
        differ.append(f"env kwargs {now} (the run's: {then})")
    limit, run_limit = (getattr(spec, "max_episode_steps", None) or None), served.get("max_episode_steps") or None
    if spec is not None and limit != run_limit:
        differ.append(f"time limit {limit or 'none'} (the run's: {run_limit or 'none'})")
    return differ


def given_kwargs_differ(given: dict[str, Any] | None, run_kwargs: dict[str, Any] | None, *, leave_out_to: str) -> str:
    """Envs made here (eval's, a resumed run's) have other spaces than the run's nets, and were made with env
    kwargs ``given`` (--env-kwargs) other than the run's (``run_kwargs``): kwargs can change an env's spaces
    (LunarLander's ``continuous``, a size, a mode), and the error named the spaces alone, not what the user
    changed. "made with --env-kwargs {...}, not the run's {...}, which may be what changed them: leave
    --env-kwargs out to ``leave_out_to``", for the caller to say whose envs; "" where none were given (None),
    or the run's were, or the run's are not known (None)."""
    if given is None or run_kwargs is None or given == run_kwargs:
        return ""
    return (
        f"made with --env-kwargs {json.dumps(given, sort_keys=True)}, not the run's "
        f"{json.dumps(run_kwargs, sort_keys=True)}, which may be what changed them: leave --env-kwargs out to "
        f"{leave_out_to}"
    )
