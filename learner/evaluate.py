"""``learner eval``: the return of a checkpoint's policy over N episodes, on local or remote envs (needs torch)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from learner.checkpoint import find_checkpoint, load_checkpoint
from learner.config import Args
from learner.envs import FleetSpec, open_fleet
from learner.local import DEFAULT_TRANSPORT
from learner.normalize import RunningMeanStd
from learner.ppo import Agent
from learner.train import pick_device

__all__ = ["evaluate"]

log = logging.getLogger(__name__)


def evaluate(
    checkpoint: str | Path,
    episodes: int = 10,
    *,
    servers: str | None = None,
    backend: str = "remote",
    num_envs: int = 4,
    seed: int = 0,
    device: str = "auto",
    deterministic: bool = True,
    transport: str = DEFAULT_TRANSPORT,
    step_socket: bool = True,
    auth_token: str | None = None,
    tls: bool | str = False,
    tls_server_name: str | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Mean and std return of ``episodes`` episodes of the policy in ``checkpoint`` (a file or a run dir).

    The envs are the run's (its env id, kwargs and wrappers): ``num_envs`` of them on one local env
    server, on the ``servers`` given, or in process (``backend="gym"``). Episodes are shared out over
    the envs in advance, as SB3's ``evaluate_policy`` does, so short episodes are not over-counted.
    ``transport`` is the local server's (``unix`` or ``tcp``); ``step_socket``, ``auth_token``, ``tls``,
    ``tls_server_name`` and ``timeout`` are RemoteVectorEnv's.
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    if num_envs < 1:
        raise ValueError(f"num_envs: expected >= 1, got {num_envs}")
    torch_device = pick_device(device)  # before loading anything: a bad --device fails at once
    path = find_checkpoint(checkpoint)
    state = load_checkpoint(path)
    run_args = Args.from_json(state["args"])
    if run_args.env is None and servers is None:  # train records the env it trained on
        raise ValueError(f"checkpoint: {path} does not name the env it was trained on; pass --servers")
    ppo = state["ppo"]
    fleet = FleetSpec(
        env=run_args.env or "",  # (unused with --servers: the servers serve their env)
        servers=servers,
        backend="gym" if backend == "gym" else "remote",
        num_servers=1,
        envs_per_server=min(num_envs, episodes),
        env_kwargs=dict(run_args.env_kwargs),
        wrappers=run_args.server_wrappers(),
        transport="unix" if transport == "unix" else "tcp",
        step_socket=step_socket,
        auth_token=auth_token,
        tls=tls,
        tls_server_name=tls_server_name,
        timeout=timeout,
        # An episode cut short by a lost server is no sample of the policy's return: fail instead.
        fault_tolerant=False,
    )
    torch.manual_seed(seed)
    with open_fleet(fleet) as envs:
        obs_space, action_space = envs.single_observation_space, envs.single_action_space
        if str(obs_space) != state["observation_space"] or str(action_space) != state["action_space"]:
            trained_on = f" ({run_args.env})" if run_args.env else ""
            env_id = getattr(envs, "env_id", None) or (None if servers else run_args.env)
            these = f"these envs ({env_id})" if env_id else "these envs"
            raise ValueError(
                f"envs: the checkpoint's policy was trained{trained_on} on observations {state['observation_space']} "
                f"and actions {state['action_space']}, but {these} have {obs_space} and {action_space}"
            )
        agent = Agent(
            obs_space, action_space, hidden_sizes=tuple(ppo["hidden_sizes"]), action_bounds=ppo["action_bounds"]
        ).to(torch_device)
        agent.load_state_dict(state["model"])
        agent.eval()
        obs_rms = None
        if state.get("obs_rms") is not None:
            obs_rms = RunningMeanStd(obs_space.shape or (), torch_device)
            obs_rms.load_state_dict(state["obs_rms"])

        n = envs.num_envs
        targets = np.array([(episodes + i) // n for i in range(n)])
        counts = np.zeros(n, dtype=np.int64)
        ep_return = np.zeros(n)
        ep_length = np.zeros(n, dtype=np.int64)
        valid = np.ones(n, dtype=bool)
        returns: list[float] = []
        lengths: list[int] = []
        next_step = envs.metadata.get("autoreset_mode") is not gym.vector.AutoresetMode.SAME_STEP
        obs, _ = envs.reset(seed=seed)
        while (counts < targets).any():
            x = torch.as_tensor(np.asarray(obs)).to(torch_device, copy=True)
            if obs_rms is not None:
                x = obs_rms.normalize(x)
            with torch.no_grad():
                actions = agent.act(x, deterministic=deterministic).cpu().numpy()
            if isinstance(action_space, gym.spaces.Box):
                actions = np.clip(actions.astype(action_space.dtype), action_space.low, action_space.high)
            obs, rewards, terms, truncs, _ = envs.step(actions)
            ep_return += np.where(valid, rewards, 0.0)
            ep_length += valid
            done = (terms | truncs) & valid
            for i in np.flatnonzero(done):
                if counts[i] < targets[i]:
                    returns.append(float(ep_return[i]))
                    lengths.append(int(ep_length[i]))
                    counts[i] += 1
                ep_return[i], ep_length[i] = 0.0, 0
            valid = ~(terms | truncs) if next_step else np.ones(n, dtype=bool)
    result = {
        "checkpoint": str(path),
        "env": run_args.env,
        "envs": f"{fleet.describe()}, {n} envs" if servers is not None else fleet.describe(),
        "episodes": len(returns),
        "deterministic": deterministic,
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "return_min": float(np.min(returns)),
        "return_max": float(np.max(returns)),
        "length_mean": float(np.mean(lengths)),
        "returns": returns,
    }
    log.info(
        "evaluated %s over %d episodes: %.2f +- %.2f", path, len(returns), result["return_mean"], result["return_std"]
    )
    return result
