"""Training end to end with tiny budgets: real local servers, episode boundaries, the run dir, resuming."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import shutil
import signal
import socket
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.checkpoint import load_checkpoint
from learner.config import Args, resolve_ppo
from learner.device import device_hint, pick_device
from learner.envs import FleetSpec, open_fleet
from learner.errors import OptionError, RunDirWriteError, TrainingInterrupted, UnusableEnvOutputError
from learner.local import DEFAULT_TRANSPORT
from learner.ppo import Agent
from learner.resume import like_args, resume_args
from learner.train import NothingToLearnError, train
from tests.conftest import QUIET, StartServers, needs_proc, on_cuda

CLOCK_ENV = "tests.envs:ClockEnv"
CAMERA_ENV = "tests.envs:CameraClockEnv"
"""ClockEnv seen as a robot's Dict: a uint8 camera frame, a float32 state vector, a Discrete phase."""


def clock(length: int = 3, **kwargs: Any) -> dict[str, Any]:
    """Args for ClockEnv: deterministic, every episode exactly ``length`` steps."""
    return {"env": CLOCK_ENV, "env_kwargs": {"length": length, **kwargs}, **QUIET}


@pytest.mark.slow
def test_tiny_training_run_through_local_servers_writes_the_whole_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(
        Args(
            env="CartPole-v1",
            num_servers=2,
            envs_per_server=2,
            num_steps=16,
            total_timesteps=3 * 64,
            checkpoint_every=2,
            checkpoint_seconds=0.0,
            stop_at_return=1000.0,
            run_dir=str(run),
            progress=False,
        )
    )
    assert summary["total_steps"] == 192 and summary["updates"] == 3
    assert summary["stop_reason"] == "total_timesteps"
    on_disk = rundir.read_json(run / rundir.SUMMARY)
    for key in ("total_steps", "seconds", "final_return_mean", "solved", "solved_at_step", "solved_at_seconds"):
        assert key in on_disk
    assert on_disk["solved"] is False and on_disk["solved_at_step"] is None and on_disk["solved_at_seconds"] is None

    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert [r["global_step"] for r in rows] == [64, 128, 192]
    for key in ("global_step", "seconds", "sps", "episodic_return_mean", "value_loss", "policy_loss", "entropy"):
        assert key in rows[-1]
    for key in ("approx_kl", "old_approx_kl", "clipfrac", "explained_variance", "num_envs", "batch_size"):
        assert key in rows[-1]
    assert rows[-1]["num_envs"] == 4
    # Each update's wall time: its rollout, its update and the rest (checkpoints, the fleet's lookups).
    previous = {"seconds": 0.0, "global_step": 0}
    for row in rows:
        wall = row["seconds"] - previous["seconds"]
        parts = row["rollout_seconds"] + row["update_seconds"] + row["other_seconds"]
        assert row["other_seconds"] >= 0 and abs(parts - wall) < 2e-3, row
        assert row["sps_update"] == pytest.approx((row["global_step"] - previous["global_step"]) / wall, rel=0.05)
        # (the transitions learned from: not the reset-only steps after an episode's end)
        assert row["transitions_per_s"] == pytest.approx(row["batch_size"] / wall, rel=0.05)
        assert row["transitions_per_s"] <= row["sps_update"]
        previous = row

    config = rundir.read_json(run / rundir.CONFIG)
    assert config["ppo"]["preset"] == "classic" and config["ppo"]["num_steps"] == 16
    assert config["envs"]["num_envs"] == 4 and len(config["envs"]["addresses"]) == 2
    # (the first update's, whatever --checkpoint-every; then every 2nd update's, and the last)
    assert [p.name for p in rundir.list_checkpoints(run)] == ["step-0000000064.pt", "step-0000000192.pt"]
    assert list(run.glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()
    tags = set(events.Tags()["scalars"])
    # CleanRL's table of the settings (TensorBoard's TEXT tab): the options, and what the preset made them
    (text,) = events.Tensors("hyperparameters/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert table.startswith("|param|value|\n|-|-|\n|env|CartPole-v1|\n"), table
    assert "\n|num_steps|16|\n" in table and "\n|ppo.num_steps|16|\n" in table and "\n|ppo.gamma|0.98|\n" in table
    cleanrl = {"charts/episodic_return", "charts/episodic_length", "charts/learning_rate", "charts/SPS"}
    cleanrl |= {f"losses/{k}" for k in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl")}
    cleanrl |= {"losses/clipfrac", "losses/explained_variance"}
    assert cleanrl <= tags, cleanrl - tags
    ours = {
        f"perf/{k}" for k in ("rollout_seconds", "update_seconds", "other_seconds", "sps_update", "transitions_per_s")
    }
    # The servers it started itself, by their places (their addresses are new each session).
    ours |= {f"replicas/local-{i}/{k}" for i in range(2) for k in ("steps", "env_p50_ms")}
    assert ours <= tags, ours - tags
    assert not any(tag.startswith("faults/") for tag in tags), tags  # (no fault in the run: no flat zeros)
    assert not any(address in tag for address in config["envs"]["addresses"] for tag in tags)
    assert (run / rundir.PLOT).stat().st_size > 10_000


def test_reset_steps_of_next_step_autoreset_never_enter_the_batch(tmp_path: Path) -> None:
    # Episodes of 3 steps: each is followed by one reset step, so 8 steps per env hold 6 transitions.
    train(Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=48, run_dir=str(tmp_path / "r")))
    rows = rundir.read_jsonl(tmp_path / "r" / rundir.METRICS)
    assert [r["batch_size"] for r in rows] == [12, 12, 12]
    assert all(r["episodic_length_mean"] == 3.0 for r in rows)
    assert rows[-1]["episodes"] == 12


def test_same_step_autoreset_servers_train_with_every_step_a_transition(
    tmp_path: Path, start_servers: StartServers
) -> None:
    addresses = start_servers(
        "tests.envs:ClockEnv", 1, 2, env_kwargs={"length": 3}, server_args=["--autoreset-mode", "SameStep"]
    )
    # No --env: the servers say what they host.
    summary = train(Args(servers=",".join(addresses), num_steps=6, total_timesteps=24, run_dir=str(tmp_path), **QUIET))
    rows = rundir.read_jsonl(tmp_path / rundir.METRICS)
    assert [r["batch_size"] for r in rows] == [12, 12]
    config = rundir.read_json(tmp_path / rundir.CONFIG)
    assert config["envs"]["env_id"] == config["args"]["env"] == "tests.envs:ClockEnv"  # eval and resume use it
    assert summary["episodes"] == 8
    # An --env the servers do not serve is refused, not silently replaced by theirs.
    wrong = Args(env="CartPole-v1", servers=",".join(addresses), run_dir=str(tmp_path / "wrong"), **QUIET)
    with pytest.raises(
        ValueError, match=r"--env: expected servers of CartPole-v1, but the server at .* serves tests.envs:ClockEnv"
    ):
        train(wrong)
    # Servers without autoreset: refused, with the way out.
    disabled = start_servers("tests.envs:ClockEnv", 1, 2, server_args=["--autoreset-mode", "Disabled"])
    with pytest.raises(ValueError, match=r"got Disabled \(PPO's rollouts .*--autoreset-mode NextStep\)"):
        train(Args(servers=disabled[0], run_dir=str(tmp_path / "disabled"), **QUIET))


def test_box_actions_train_with_the_mujoco_preset(tmp_path: Path) -> None:
    summary = train(
        Args(
            **clock(4, action="box"), backend="gym", num_envs=2, num_steps=10, total_timesteps=40, run_dir=str(tmp_path)
        )
    )
    config = rundir.read_json(tmp_path / rundir.CONFIG)
    assert config["ppo"]["preset"] == "mujoco" and config["ppo"]["norm_obs"] and config["ppo"]["norm_reward"]
    assert summary["episodes"] == 8


def test_dict_observations_train_on_same_step_autoreset_servers_bootstrapping_truncations_from_their_final_dicts(
    tmp_path: Path, start_servers: StartServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under same-step autoreset a truncated episode's last observation (a Dict) comes only in infos["final_obs"],
    # and V(it) bootstraps the truncation: Box actions (the mujoco preset) normalise the state vector alone.
    from learner import train as train_module

    finals: list[dict[str, Any]] = []
    value_final = train_module.Acting.value_final

    def watched(self: Any, storage: Any, step: int, truncated: np.ndarray, infos: dict[str, Any]) -> None:
        value_final(self, storage, step, truncated, infos)
        finals.append({"step": step, "values": storage.final_values[step].clone(), "truncated": truncated.copy()})

    monkeypatch.setattr(train_module.Acting, "value_final", watched)
    addresses = start_servers(
        CAMERA_ENV, 1, 2, env_kwargs={"length": 3, "action": "box"}, server_args=["--autoreset-mode", "SameStep"]
    )
    summary = train(Args(servers=",".join(addresses), num_steps=6, total_timesteps=24, run_dir=str(tmp_path), **QUIET))
    assert [r["batch_size"] for r in rundir.read_jsonl(tmp_path / rundir.METRICS)] == [12, 12]
    assert summary["episodes"] == 8
    # Every third step truncates both envs' episodes; their final values were computed from the final Dicts.
    assert [f["step"] for f in finals] == [2, 5, 2, 5] and all(f["truncated"].all() for f in finals)
    assert all(bool(f["values"].ne(0).all()) for f in finals)
    config = rundir.read_json(tmp_path / rundir.CONFIG)
    assert config["policy"] == "Dict: Nature CNN per image key, MLP 64,64" and config["ppo"]["norm_obs"]
    checkpoint = load_checkpoint(rundir.list_checkpoints(tmp_path)[-1])
    assert sorted(checkpoint["obs_rms"]) == ["state/count", "state/mean", "state/var"]
    assert any(key.startswith("combined.cnns.image.") for key in checkpoint["model"])


def test_a_dicts_multibinary_and_multidiscrete_keys_train_stored_as_integers_and_evaluate(
    tmp_path: Path, start_servers: StartServers
) -> None:
    # SB3's CombinedExtractor takes them (one-hot per sub-space, 0/1 values): so does learner train, on servers
    # and in process, the rollout keeping them as bytes and int64; --norm-obs (the mujoco preset's, Box actions)
    # normalises the state vector alone; learner eval acts on them.
    from learner import train as train_module
    from learner.evaluate import evaluate
    from tests.envs import CameraClockEnv

    kwargs = {"length": 3, "action": "box", "multi": True}
    addresses = start_servers(CAMERA_ENV, 1, 2, env_kwargs=kwargs)
    run = tmp_path / "served"
    served = Args(servers=",".join(addresses), num_steps=6, num_minibatches=2, total_timesteps=24, run_dir=str(run))
    assert train(dataclasses.replace(served, **QUIET))["episodes"] == 6  # (next-step autoreset: 3 steps, a reset)
    checkpoint = load_checkpoint(rundir.list_checkpoints(run)[-1])
    assert "gear" in checkpoint["observation_space"] and sorted(checkpoint["obs_rms"]) == [
        "state/count",
        "state/mean",
        "state/var",
    ]
    shapes, dtypes = train_module._obs_storage(CameraClockEnv(multi=True).observation_space)
    assert isinstance(shapes, dict) and isinstance(dtypes, dict)
    assert (shapes["buttons"], dtypes["buttons"], shapes["gear"], dtypes["gear"]) == (
        (2,),
        torch.uint8,
        (2,),
        torch.int64,
    )
    in_process = Args(
        env=CAMERA_ENV, env_kwargs=kwargs, backend="gym", num_envs=2, num_steps=6, num_minibatches=2, total_timesteps=12
    )
    train(dataclasses.replace(in_process, run_dir=str(tmp_path / "gym"), **QUIET))
    result = evaluate(str(run), episodes=2, servers=",".join(addresses), progress=False)
    assert result["episodes"] == 2


@pytest.mark.parametrize("action", ["box", "discrete"])
def test_a_nan_in_a_dict_observation_stops_the_run_naming_the_key_and_env(tmp_path: Path, action: str) -> None:
    # Box actions (and --norm-obs) look at the observations as they come; a categorical policy on the CPU
    # explains its forward's error afterwards: either way the error names the Dict's key.
    args = Args(
        **{**clock(3, action=action, nan_at=2), "env": CAMERA_ENV},
        backend="gym",
        num_envs=2,
        num_steps=8,
        total_timesteps=32,
        run_dir=str(tmp_path / "run"),
    )
    with pytest.raises(UnusableEnvOutputError, match=r"observation\['state'\] of env 0 has NaN or infinite values"):
        train(args)


def test_a_rollout_of_dict_observations_counts_each_keys_bytes_against_the_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from learner import train as train_module

    space = gym.spaces.Dict(
        {"image": gym.spaces.Box(0, 255, (84, 84, 3), np.uint8), "state": gym.spaces.Box(-1, 1, (7,), np.float32)}
    )
    stored = train_module._obs_storage(space)
    assert stored == ({"image": (84, 84, 3), "state": (7,)}, {"image": torch.uint8, "state": torch.float32})
    hp = dataclasses.replace(
        resolve_ppo(Args(**clock(3)), space, gym.spaces.Discrete(2)), num_steps=128, num_minibatches=4
    )
    # 512 steps' bytes (21,168 + 28), twice (the rollout, the update's copy), a minibatch of 128 of them made float32
    # besides, and 64 bytes a step of the rest: 35,292,160.
    monkeypatch.setattr(train_module, "available_memory", lambda device: (1000, "this machine"))
    with pytest.raises(
        OptionError,
        match=r"^--num-steps 128 x 4 envs: a rollout of Dict \('image': \(84, 84, 3\) uint8, 'state': \(7,\) float32\) "
        r"observations and its update need at least 35\.3 MB on cpu",
    ):
        train_module._check_rollout_memory(hp, 4, *stored, torch.device("cpu"))


def test_an_updates_batch_is_let_go_before_the_next_rollout_and_overlap_update_counts_the_one_still_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The memory check counts two copies of the observations, the rollout's and the update's batch: the loop must
    # not hold the last batch (made of the last rollout) through the next rollout, and into the next batch's
    # making, a third copy (a camera's frames: tens of megabytes at the mujoco preset's 2048 steps). With
    # --overlap-update the batch of the update still running is in use as the next is made: counted.
    from learner import train as train_module

    made: list[weakref.ref[Any]] = []
    alive_when_made: list[list[bool]] = []
    make_batch = train_module.make_batch

    def watched(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        alive_when_made.append([ref() is not None for ref in made])
        batch = make_batch(*args, **kwargs)
        assert isinstance(batch.obs, dict)
        made.append(weakref.ref(batch.obs["image"]))
        return batch

    monkeypatch.setattr(train_module, "make_batch", watched)
    args = Args(
        **{**clock(3), "env": CAMERA_ENV},
        backend="gym",
        num_envs=2,
        num_steps=8,
        total_timesteps=48,
        run_dir=str(tmp_path),
    )
    train(args)
    assert alive_when_made == [[], [False], [False, False]]

    space = gym.spaces.Dict(
        {"image": gym.spaces.Box(0, 255, (84, 84, 3), np.uint8), "state": gym.spaces.Box(-1, 1, (7,), np.float32)}
    )
    stored = train_module._obs_storage(space)
    hp = dataclasses.replace(
        resolve_ppo(Args(**clock(3)), space, gym.spaces.Discrete(2)), num_steps=128, num_minibatches=4
    )
    monkeypatch.setattr(train_module, "available_memory", lambda device: (1000, "this machine"))
    # 35,292,160 bytes as above, and 512 steps' 21,196 bytes once more: 46,144,512.
    with pytest.raises(OptionError, match=r"observations and its update need at least 46\.1 MB on cpu"):
        train_module._check_rollout_memory(hp, 4, *stored, torch.device("cpu"), overlap=True)


@pytest.mark.parametrize("backend", ["remote", "gym"])
def test_max_episode_steps_is_the_time_limit_of_the_envs_this_command_starts(
    tmp_path: Path, backend: Literal["remote", "gym"]
) -> None:
    # ClockEnv's episodes last 100 steps; --max-episode-steps 5 truncates them after 5.
    args = Args(
        **clock(100),
        backend=backend,
        num_servers=1,
        envs_per_server=2,
        num_steps=24,
        total_timesteps=48,
        max_episode_steps=5,
        reset_timeout=20.0,
        checkpoint_every=0,
        run_dir=str(tmp_path / "run"),
    )
    summary = train(args)
    assert summary["total_steps"] == 48
    assert rundir.read_jsonl(tmp_path / "run" / rundir.METRICS)[-1]["episodic_length_mean"] == 5
    with pytest.raises(ValueError, match=r"--max-episode-steps: configures the env servers this command starts"):
        Args(servers="localhost:1", max_episode_steps=5)


def resume_as_killed(full: Path, part: Path, last: str) -> None:
    """Copy the finished run ``full`` to ``part`` as if it had been killed once checkpoint ``last`` was written (the
    newer checkpoints gone, metrics.jsonl's later lines kept, as a kill leaves them), and resume it there."""
    shutil.copytree(full, part)
    for checkpoint in rundir.list_checkpoints(part):
        if checkpoint.name > last:
            checkpoint.unlink()
    train(resume_args(part))


def _resumable(env: str = CLOCK_ENV) -> dict[str, Any]:
    """Runs of 3 updates of 16 steps whose every update boundary finds the envs at their start (``env``: ClockEnv
    or its Dict observations' CameraClockEnv)."""
    return {
        **clock(3, action="box"),
        "env": env,
        "backend": "gym",
        "num_envs": 2,
        "num_steps": 8,
        "num_minibatches": 2,
        "update_epochs": 3,
        "total_timesteps": 48,
        "keep_checkpoints": 10,
        "checkpoint_seconds": 0.0,
    }


@pytest.mark.parametrize(
    ("seconds", "every", "written"), [(0.0, 1, [16, 32, 48]), (3600.0, 1, [16, 48]), (0.0, 2, [16, 48]), (0.0, 0, [48])]
)
def test_checkpoints_are_checkpoint_seconds_apart_besides_the_last(
    tmp_path: Path, seconds: float, every: int, written: list[int]
) -> None:
    # (The default, 30 s, keeps a fast run from writing a checkpoint every fraction of a second. The
    # first update's is written regardless: a run killed before any could only start over.)
    run = tmp_path / "run"
    train(Args(**{**_resumable(), "checkpoint_seconds": seconds}, checkpoint_every=every, run_dir=str(run)))
    assert [p.name for p in rundir.list_checkpoints(run)] == [f"step-{step:010d}.pt" for step in written]


@pytest.mark.parametrize(("env", "rms_mean"), [(CLOCK_ENV, "mean"), (CAMERA_ENV, "state/mean")], ids=["Box", "Dict"])
def test_resuming_from_a_checkpoint_gives_the_same_next_update_as_an_uninterrupted_run(
    tmp_path: Path, env: str, rms_mean: str
) -> None:
    # ClockEnv's episodes (3 steps + 1 reset step) divide the rollout (8 steps), so at every update
    # boundary each env is back at its start, as after a fresh reset: what the learner's checkpoint
    # holds (nets, optimizer, normalisers, counters, RNG states) alone decides what comes next.
    # Box actions and the mujoco preset put every piece of learner state to work (for Dict observations,
    # --norm-obs's statistics of the state vector, a CNN for the camera frames).
    common = {**_resumable(env), "checkpoint_every": 1}
    full = tmp_path / "full"
    train(Args(**common, run_dir=str(full)))

    # The same run, as if killed after its second update: its last checkpoint is step 32, and
    # metrics.jsonl already holds a line for an update the checkpoint does not have.
    part = tmp_path / "part"
    resume_as_killed(full, part, "step-0000000032.pt")

    full_rows, part_rows = rundir.read_jsonl(full / rundir.METRICS), rundir.read_jsonl(part / rundir.METRICS)
    assert [r["update"] for r in part_rows] == [1, 2, 3]
    timing = ("seconds", "sps", "sps_update", "transitions_per_s", "rollout_seconds", "update_seconds", "other_seconds")
    for a, b in zip(full_rows, part_rows, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    a, b = (torch.load(rundir.list_checkpoints(d)[-1], weights_only=True) for d in (full, part))
    assert a["counters"]["global_step"] == b["counters"]["global_step"] == 48
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, b["optimizer"]["state"][key][name]), (key, name)
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert torch.equal(a["obs_rms"][rms_mean], b["obs_rms"][rms_mean])


class CtrlCAt(gym.vector.VectorWrapper):
    """Sends this process SIGINT (a Ctrl-C) right after the ``at``-th step of the envs it wraps."""

    def __init__(self, env: gym.vector.VectorEnv, at: int) -> None:
        super().__init__(env)
        self.at, self.steps = at, 0

    def step(self, actions: Any) -> Any:
        result = self.env.step(actions)
        self.steps += 1
        if self.steps == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return result


@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_ctrl_c_mid_rollout_saves_the_last_update_and_resuming_gives_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_every: int
) -> None:
    # As in the test above; the Ctrl-C comes at the 3rd step of the second rollout (global step 20).
    # The steps of that rollout, the episodes they ended, the RNG draws and observation statistics of
    # the actions taken are not in the checkpoint: it is the one of update 1 (step 16).
    common = _resumable()
    full = tmp_path / "full"
    train(Args(**common, checkpoint_every=1, run_dir=str(full)))

    @contextlib.contextmanager
    def interrupted_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=8 + 3)

    part = tmp_path / "part"
    with monkeypatch.context() as patch:
        patch.setattr("learner.train.open_fleet", interrupted_fleet)
        with pytest.raises(TrainingInterrupted) as stopped:  # (its files written: then the caller stops too)
            train(Args(**common, checkpoint_every=checkpoint_every, run_dir=str(part)))
    summary = stopped.value.summary
    assert summary["stop_reason"] == "interrupted" and stopped.value.run_dir == part
    assert summary == {**rundir.read_json(part / rundir.SUMMARY), "run_dir": str(part)}
    assert summary["total_steps"] == 16 and summary["updates"] == 1
    assert summary["episodes"] == rundir.read_jsonl(full / rundir.METRICS)[0]["episodes"]
    assert [p.name for p in rundir.list_checkpoints(part)] == ["step-0000000016.pt"]
    a, b = (torch.load(d / "checkpoints" / "step-0000000016.pt", weights_only=True) for d in (full, part))
    assert {k: v for k, v in a["counters"].items() if k != "seconds"} == {
        k: v for k, v in b["counters"].items() if k != "seconds"
    }
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["rng"]["python"] == b["rng"]["python"]
    assert torch.equal(a["rng"]["numpy"]["keys"], b["rng"]["numpy"]["keys"])
    for key in ("mean", "var", "count"):
        assert torch.equal(a["obs_rms"][key], b["obs_rms"][key]), key

    train(resume_args(part, checkpoint_every=1))
    full_rows, part_rows = rundir.read_jsonl(full / rundir.METRICS), rundir.read_jsonl(part / rundir.METRICS)
    timing = ("seconds", "sps", "sps_update", "transitions_per_s", "rollout_seconds", "update_seconds", "other_seconds")
    assert [{k: v for k, v in r.items() if k not in timing} for r in part_rows] == [
        {k: v for k, v in r.items() if k not in timing} for r in full_rows
    ]
    a, b = (torch.load(rundir.list_checkpoints(d)[-1], weights_only=True) for d in (full, part))
    assert a["counters"]["global_step"] == b["counters"]["global_step"] == 48
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


def test_ctrl_c_stops_a_loop_over_seeds_after_the_run_it_came_in_with_that_run_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook's kernel interrupt (SIGINT) in ``for seed in ...: train(...)``: the run stops as asked,
    with its checkpoint, summary and plot, then TrainingInterrupted (a KeyboardInterrupt) stops the loop,
    so that the next seeds do not start. A run stopped by its budget returns, as ever."""

    @contextlib.contextmanager
    def interrupted_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=8 + 3)

    started = []
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt) as stopped:
        patch.setattr("learner.train.open_fleet", interrupted_fleet)
        for seed in (1, 2, 3):
            started.append(seed)
            train(Args(**{**_resumable(), "plot": True}, seed=seed, run_dir=str(tmp_path / f"seed{seed}")))
    assert started == [1] and isinstance(stopped.value, TrainingInterrupted)
    run = tmp_path / "seed1"
    assert stopped.value.run_dir == run and stopped.value.summary["run_dir"] == str(run)
    assert stopped.value.summary["total_steps"] == 16 and stopped.value.summary["stop_reason"] == "interrupted"
    assert [p.name for p in rundir.list_checkpoints(run)] == ["step-0000000016.pt"]
    assert (run / rundir.SUMMARY).is_file() and (run / rundir.PLOT).is_file()
    assert f"go on with train(resume_args({str(run)!r}))" in str(stopped.value)
    summary = train(resume_args(run))  # (as the message says)
    assert summary["stop_reason"] == "total_timesteps" and summary["total_steps"] == 48


def test_ctrl_c_during_the_last_update_still_stops_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that comes during a run's last update: the run ends as finished (its budget spent, its
    last update done and written), and TrainingInterrupted stops the caller all the same."""
    from learner import update as update_module

    calls = []

    def interrupted_in_the_last(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:  # (48 steps: the third update is the last)
            os.kill(os.getpid(), signal.SIGINT)
        return update_module.ppo_update(*args, **kwargs)

    monkeypatch.setattr("learner.train.ppo_update", interrupted_in_the_last)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(Args(**_resumable(), run_dir=str(tmp_path / "run")))
    assert stopped.value.summary["stop_reason"] == "total_timesteps" and stopped.value.summary["total_steps"] == 48


def test_train_leaves_torch_s_thread_count_as_it_found_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLP on the CPU trains on one torch thread; the caller's process (a notebook's kernel) gets its
    own count back, and its cudnn.deterministic, whether the run finished or was stopped."""
    seen: list[int] = []
    interrupt: list[bool] = []

    class Threads(gym.vector.VectorWrapper):
        def step(self, actions: Any) -> Any:
            seen.append(torch.get_num_threads())
            return self.env.step(actions)

    @contextlib.contextmanager
    def counting_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(Threads(envs), at=8 + 3) if interrupt else Threads(envs)

    before = torch.get_num_threads()
    monkeypatch.setattr("learner.train.open_fleet", counting_fleet)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    try:
        torch.set_num_threads(3)
        train(Args(**_resumable(), device="cpu", run_dir=str(tmp_path / "finished")))
        assert set(seen) == {1} and torch.get_num_threads() == 3
        assert torch.backends.cudnn.deterministic is False  # (the run's default, --torch-deterministic, is True)
        seen.clear()
        interrupt.append(True)
        with pytest.raises(TrainingInterrupted):
            train(Args(**_resumable(), device="cpu", run_dir=str(tmp_path / "stopped")))
        assert set(seen) == {1} and torch.get_num_threads() == 3
        assert torch.backends.cudnn.deterministic is False
    finally:
        torch.set_num_threads(before)


def test_a_run_dir_that_holds_a_run_is_not_overwritten(tmp_path: Path) -> None:
    args = Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=4, run_dir=str(tmp_path))
    train(args)
    with pytest.raises(FileExistsError, match="--resume"):
        train(args)


def test_a_run_stopped_before_its_first_checkpoint_starts_over_where_it_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed in its first update (or --checkpoint-every 0, killed before the end): nothing to resume
    from. --resume and the same --run-dir both start it over, its files set aside (never mixed in)."""
    run = tmp_path / "r"
    args = Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=8, run_dir=str(run))
    assert args.run_dir is not None
    train(args)
    stopped = []
    for again in (lambda: train(resume_args(args.run_dir)), lambda: train(args)):
        # As if killed in its first update, before its first checkpoint: no summary, no row past that update's.
        shutil.rmtree(run / rundir.CHECKPOINTS)
        (run / rundir.SUMMARY).unlink()
        rundir.rewrite_jsonl(run / rundir.METRICS, rundir.read_jsonl(run / rundir.METRICS)[:1])
        stopped.append(rundir.read_jsonl(run / rundir.METRICS))
        caplog.clear()
        summary = again()
        assert summary["total_steps"] == 8 and summary["updates"] == 2
        assert [r["update"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [1, 2]
        assert "and this run starts over" in caplog.text, caplog.text
    assert "--resume" not in caplog.text  # (the second: --run-dir, as a Kubernetes Job's new pod does)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("previous")) == ["previous", "previous-2"]
    for aside, rows in zip(("previous", "previous-2"), stopped, strict=True):
        assert rundir.read_jsonl(run / aside / rundir.METRICS) == rows
        assert (run / aside / rundir.CONFIG).is_file()


def test_a_run_dir_is_held_by_one_learner_at_a_time(tmp_path: Path) -> None:
    """Two learners on one run dir (a resume while the run still runs) would lose each other's metrics
    and checkpoints: the second is refused, naming the holder; the lock goes with its holder."""
    args = Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=4, run_dir=str(tmp_path / "r"))
    assert args.run_dir is not None
    train(args)
    with (
        rundir.lock(tmp_path / "r"),
        pytest.raises(
            FileExistsError,
            match=rf"run dir {tmp_path / 'r'}: in use by another learner \(pid {os.getpid()} on {socket.gethostname()}\)",
        ),
    ):
        train(resume_args(args.run_dir, total_timesteps=8))
    assert train(resume_args(args.run_dir, total_timesteps=8))["total_steps"] == 8


def test_a_resumed_run_keeps_what_its_nets_were_trained_on(tmp_path: Path) -> None:
    """--norm-obs/--norm-reward (or a preset) turning normalisation on or off would feed the nets other
    observations and returns: refused, naming the option, before anything is written."""
    args = Args(**_resumable(), run_dir=str(tmp_path / "r"))  # (the mujoco preset: both on)
    assert args.run_dir is not None
    train(args)
    before = rundir.read_jsonl(tmp_path / "r" / rundir.METRICS)
    for override, flag in ((dict(norm_obs=False), "--norm-obs"), (dict(preset="classic"), "--norm-obs")):
        with pytest.raises(ValueError, match=rf"{flag}: the run in .* was trained with it; .* give {flag}\)"):
            train(resume_args(args.run_dir, total_timesteps=64, **override))
    with pytest.raises(ValueError, match=r"--norm-reward: the run in .* was trained with it"):
        train(resume_args(args.run_dir, total_timesteps=64, norm_reward=False))
    assert rundir.read_jsonl(tmp_path / "r" / rundir.METRICS) == before


def test_a_resumed_run_keeps_the_tensorboard_point_of_its_checkpointed_update(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = Args(**{**_resumable(), "tensorboard": True}, run_dir=str(tmp_path / "r"))
    assert args.run_dir is not None
    train(dataclasses.replace(args, total_timesteps=32))
    train(resume_args(args.run_dir, total_timesteps=48))
    events = EventAccumulator(str(tmp_path / "r")).Reload()
    assert [e.step for e in events.Scalars("charts/learning_rate")] == [16, 32, 48]


def test_runs_started_in_the_same_second_get_a_run_dir_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds started in parallel: the default runs/<env>-<time> is taken by the first, the next gets -2, ..."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("learner.config.time.strftime", lambda _format: "20261201-030846")
    dirs = []
    for seed in (1, 2):
        args = Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=4, seed=seed)
        train(args)
        dirs.append(sorted(p.name for p in (tmp_path / "runs").iterdir()))
    assert dirs == [
        ["tests.envs-ClockEnv-20261201-030846"],
        ["tests.envs-ClockEnv-20261201-030846", "tests.envs-ClockEnv-20261201-030846-2"],
    ]
    for name, seed in (("tests.envs-ClockEnv-20261201-030846", 1), ("tests.envs-ClockEnv-20261201-030846-2", 2)):
        assert json.loads((tmp_path / "runs" / name / "config.json").read_text())["args"]["seed"] == seed


def test_minibatches_of_fewer_than_two_transitions_are_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone transition's normalised advantage is 0: such a run's policy would learn nothing, silently."""
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=4, total_timesteps=8)
    for minibatches, norm_adv, warned in ((5, True, True), (4, True, False), (8, False, False)):
        caplog.clear()
        run = tmp_path / f"{minibatches}-{norm_adv}"
        with caplog.at_level(logging.WARNING, logger="learner.train"):
            train(dataclasses.replace(args, num_minibatches=minibatches, norm_adv=norm_adv, run_dir=str(run)))
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--num-minibatches")]
        assert bool(said) == warned, said
        if warned:
            assert "a batch of 8 transitions (2 envs x --num-steps 4) leaves fewer than 2" in said[0]
            assert said[0].endswith("pass at most 4 (or more envs or steps)")


def test_make_new_dir_never_hands_out_a_folder_twice(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "x"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: rundir.make_new_dir(base), range(16)))
    assert len(set(made)) == 16 and made[0].parent == base.parent
    assert {p.name for p in made} == {"x", *(f"x-{n}" for n in range(2, 17))}


def test_run_dir_files_get_the_mode_the_umask_gives_when_written(tmp_path: Path) -> None:
    """Written atomically (a temporary file, then a rename), with a normal file's mode: 0666 less the umask
    as it is when written (rundir reads no umask at import)."""
    before = os.umask(0o027)
    try:
        rundir.write_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(before)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    assert rundir.read_json(tmp_path / "a.json") == {"x": 1} and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_atari_trains_end_to_end_on_frame_stacks_from_the_servers(tmp_path: Path) -> None:
    pytest.importorskip("ale_py")
    summary = train(
        Args(
            env="ALE/Pong-v5",
            num_servers=1,
            envs_per_server=2,
            num_steps=8,
            total_timesteps=16,
            run_dir=str(tmp_path),
            **QUIET,
        )
    )
    config = rundir.read_json(tmp_path / rundir.CONFIG)
    assert config["ppo"]["preset"] == "atari" and config["ppo"]["clip_reward"]
    assert config["envs"]["observation_space"] == "Box(0, 255, (4, 84, 84), uint8)"
    assert summary["updates"] == 1


def test_pipelined_training_keeps_episode_boundaries_and_records_replica_stats(tmp_path: Path) -> None:
    """--pipeline-groups 2: each server steps while the policy runs on the other's envs; same accounting."""
    # (the same samples grouped or not: so on the CPU; CUDA's generator gives a split batch other numbers)
    common = {
        **clock(3),
        "num_servers": 2,
        "envs_per_server": 2,
        "num_steps": 8,
        "total_timesteps": 96,
        "device": "cpu",
    }
    plain = train(Args(**common, run_dir=str(tmp_path / "plain")))
    piped = train(Args(**common, pipeline_groups=2, run_dir=str(tmp_path / "piped")))
    plain_rows = rundir.read_jsonl(tmp_path / "plain" / rundir.METRICS)
    piped_rows = rundir.read_jsonl(tmp_path / "piped" / rundir.METRICS)
    for key in ("global_step", "batch_size", "episodes", "episodic_length_mean", "episodic_return_mean"):
        assert [r[key] for r in piped_rows] == [r[key] for r in plain_rows], key
    assert piped["episodes"] == plain["episodes"] == 24
    for run, rows in (("plain", plain_rows), ("piped", piped_rows)):
        # Servers the learner started: local-<i> (--servers: by address; see test_train_fleet).
        addresses = ["local-0", "local-1"]
        assert not any(k.startswith(("replicas/0/", "replicas/1/")) for k in rows[-1])
        for address in addresses:
            assert rows[-1][f"replicas/{address}/steps"] == 8  # batched steps of this update
            assert rows[-1][f"replicas/{address}/num_envs"] == 2
            for stat in ("latency_p50_ms", "latency_p99_ms", "env_p50_ms", "env_p99_ms", "env_steps_per_s"):
                assert rows[-1][f"replicas/{address}/{stat}"] > 0
            assert rows[-1][f"replicas/{address}/latency_max_ms"] >= rows[-1][f"replicas/{address}/latency_p99_ms"]
        # summary.json: this session's figures per server.
        replicas = rundir.read_json(tmp_path / run / rundir.SUMMARY)["replicas"]
        assert set(replicas) == set(addresses)
        for address, totals in replicas.items():
            assert totals["steps"] == 8 * len(rows) and totals["num_envs"] == 2 and totals["failures"] == 0
            assert totals["env_p50_ms"] > 0 and totals["latency_p50_ms"] >= totals["env_p50_ms"]
            assert totals["latency_max_ms"] >= max(r[f"replicas/{address}/latency_max_ms"] for r in rows) - 1e-4


def test_pipelining_needs_env_servers() -> None:
    with pytest.raises(ValueError, match="--pipeline-groups: pipelines env servers"):
        Args(backend="gym", pipeline_groups=2)
    other = "tcp" if DEFAULT_TRANSPORT == "unix" else "unix"
    with pytest.raises(
        ValueError, match="--transport: says how to reach env servers, so it cannot go with --backend gym"
    ):
        Args(backend="gym", transport=other)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--no-step-socket: says how to reach env servers"):
        Args(backend="gym", step_socket=False)
    with pytest.raises(ValueError, match=r"--transport: .* with --servers the addresses say it"):
        Args(servers="127.0.0.1:1", transport=other)  # type: ignore[arg-type]
    Args(servers="unix:/tmp/x.sock", step_socket=False)  # (unix: addresses have step sockets)
    # A group is at least one server: more groups than the local servers is refused, not ignored.
    with pytest.raises(
        ValueError,
        match=r"--pipeline-groups: expected at most one group per env server, so at most 1 for the 1 local server "
        r"this command starts, got 2",
    ):
        Args(num_servers=1, pipeline_groups=2)
    with pytest.raises(ValueError, match="so at most 1 for the 1 local server"):
        Args(num_envs=1, pipeline_groups=2)  # (one env: one server, whatever --num-servers)
    assert Args(num_servers=2, pipeline_groups=2).pipeline_groups == 2


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_the_best_update_so_far_is_kept_as_best_pt(tmp_path: Path, overlap: bool) -> None:
    """checkpoints/best.pt: the nets after the update with the highest mean return of the last 20
    episodes (judged once 20 have ended), beside the latest checkpoints and never pruned with them."""
    run = tmp_path / "run"
    kwargs = clock(length=3) | {"backend": "gym", "num_envs": 4, "num_steps": 8, "total_timesteps": 32 * 12}
    summary = train(Args(**kwargs, run_dir=str(run), keep_checkpoints=1, overlap_update=overlap))
    rows = rundir.read_jsonl(run / rundir.METRICS)
    judged = [r for r in rows if r["episodes"] >= 20]
    best = max(judged, key=lambda r: r["episodic_return_mean"])  # (the first, where several tie)
    assert (summary["best_return"], summary["best_step"]) == (best["episodic_return_mean"], best["global_step"])
    saved = load_checkpoint(run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT)
    assert saved["counters"]["global_step"] == best["global_step"]
    assert saved["counters"]["best_return"] == best["episodic_return_mean"]
    assert [p.name for p in rundir.list_checkpoints(run)] == [f"step-{32 * 12:010d}.pt"]  # pruned: the others
    assert rundir.BEST_CHECKPOINT not in [p.name for p in rundir.list_checkpoints(run)]
    # Off: judged all the same (summary.json), no file.
    other = tmp_path / "other"
    summary = train(Args(**kwargs, run_dir=str(other), save_best=False, overlap_update=overlap))
    assert summary["best_return"] is not None
    assert not (other / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT).exists()


def test_a_resumed_run_keeps_to_the_bar_of_a_best_pt_newer_than_its_checkpoint(tmp_path: Path) -> None:
    """A run killed between writing best.pt and its next checkpoint: resumed, it does not replace that
    best.pt with a worse one."""
    run = tmp_path / "run"
    kwargs = clock(length=3) | {"backend": "gym", "num_envs": 4, "num_steps": 8}
    train(Args(**kwargs, total_timesteps=32 * 8, run_dir=str(run)))
    best_file = run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
    best = torch.load(best_file, weights_only=False)
    best["counters"]["best_return"] = 99.0  # (as if a later update had done this well, then the kill)
    torch.save(best, best_file)
    summary = train(resume_args(str(run), total_timesteps=32 * 12))
    assert summary["best_return"] == 99.0
    assert load_checkpoint(best_file)["counters"]["best_return"] == 99.0
    # The bar is the file's whenever best.pt is kept: after a session without it, too.
    (run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT).unlink()
    summary = train(resume_args(str(run), total_timesteps=32 * 14, save_best=False))
    assert summary["best_return"] == 99.0  # (judged on, from the checkpoint's bar; no file written)
    assert not best_file.exists()
    summary = train(resume_args(str(run), total_timesteps=32 * 16, save_best=True))  # (resume keeps options)
    assert summary["best_return"] == load_checkpoint(best_file)["counters"]["best_return"] < 99.0


def test_auto_device_warns_only_for_an_mlp_it_put_on_cuda() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    hint = device_hint("auto", cuda, image=False)
    assert hint is not None and "--device cpu" in hint
    # Asked for by name, a CNN policy (where the GPU pays), or the CPU: no warning.
    assert device_hint("cuda", cuda, image=False) is None
    assert device_hint("auto", cuda, image=True) is None
    assert device_hint("auto", cpu, image=False) is None


def test_a_run_resumes_on_running_servers(tmp_path: Path, start_servers: StartServers) -> None:
    run = tmp_path / "run"
    train(Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=16, run_dir=str(run)))
    addresses = start_servers("tests.envs:ClockEnv", 2, 1, env_kwargs={"length": 3})
    summary = train(resume_args(run, servers=",".join(addresses), backend="remote", total_timesteps=32))
    assert summary["total_steps"] == 32
    config = rundir.read_json(run / rundir.CONFIG)
    assert config["envs"]["addresses"] == addresses and config["args"]["num_envs"] is None


def test_a_run_made_on_servers_resumes_on_envs_this_command_starts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(Args(**clock(3), backend="gym", num_envs=3, num_steps=8, total_timesteps=24, run_dir=str(run)))
    # As if it had trained on running servers of 3 envs (what config.json says of such a run).
    config = rundir.read_json(run / rundir.CONFIG)
    saved = Args.from_json(config["args"])
    config["args"] = dataclasses.replace(
        saved, servers="127.0.0.1:1", backend="remote", num_envs=None, env_kwargs={}, tls=True, pipeline_groups=4
    ).to_json()
    rundir.write_json(run / rundir.CONFIG, config)
    # The servers' address comes from config.json: an option that needs local servers says so, and how.
    other = "tcp" if DEFAULT_TRANSPORT == "unix" else "unix"
    with pytest.raises(ValueError) as refused:
        resume_args(run, transport=other)
    assert str(refused.value).endswith(
        "(--servers 127.0.0.1:1 comes from the run's config.json; to resume the run on envs this command starts, "
        "give --backend, --num-servers, --num-envs or --envs-per-server)"
    )
    with pytest.raises(ValueError, match=r"--servers: expected addresses .* got ''; to resume the run in .* leave"):
        resume_args(run, servers="")
    with pytest.raises(ValueError, match="trained on 3 envs, which do not split evenly over 2 servers"):
        resume_args(run, num_servers=2, env=CLOCK_ENV)
    # Given a layout, it moves: the same env, as many envs (on servers that split them), no TLS.
    moved = resume_args(run, backend="remote", env=CLOCK_ENV)  # (named again: see test_eval)
    assert (moved.servers, moved.env, moved.num_envs, moved.local_layout(), moved.tls) == (
        None,
        "tests.envs:ClockEnv",
        3,
        (1, 3),
        False,
    )
    assert moved.pipeline_groups == 1  # (sized for the servers it left: 4 would be refused on 1 server)
    assert resume_args(run, backend="gym", env=CLOCK_ENV).pipeline_groups == 1
    assert resume_args(run, num_servers=3, pipeline_groups=3, env=CLOCK_ENV).pipeline_groups == 3
    assert resume_args(run, num_servers=3, env=CLOCK_ENV).local_layout() == (3, 1)
    assert resume_args(run, num_servers=2, num_envs=4, env=CLOCK_ENV).local_layout() == (2, 2)
    gym_args = resume_args(run, backend="gym", env=CLOCK_ENV, env_kwargs={"length": 3}, total_timesteps=48, **QUIET)
    assert (gym_args.backend, gym_args.local_layout()) == ("gym", (1, 3))
    summary = train(gym_args)
    assert summary["total_steps"] == 48 and summary["stop_reason"] == "total_timesteps"


# -- --overlap-update: the update of each rollout runs while the next one is collected -------------------------


def _without_timing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    timing = ("seconds", "sps", "sps_update", "transitions_per_s", "rollout_seconds", "update_seconds", "other_seconds")
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_cuda)])
def test_overlapped_updates_learn_each_rollout_once_from_nets_one_update_behind(tmp_path: Path, device: str) -> None:
    # One minibatch (no shuffling): the first update learns from the same rollout with the same nets
    # as in a sequential run, so it reports the same losses. The second rollout was collected by the
    # nets from before the first update (sequential: after it), so from then on the runs differ.
    # (On CUDA too: the update thread's kernels and the acting copy's share the GPU.)
    common = {**clock(3), "backend": "gym", "num_envs": 2, "num_steps": 8, "num_minibatches": 1, "update_epochs": 2}
    common |= {"device": device}
    common |= {"total_timesteps": 64, "checkpoint_every": 0}
    train(Args(**common, run_dir=str(tmp_path / "sequential")))
    for name in ("overlap", "again"):
        summary = train(Args(**common, overlap_update=True, run_dir=str(tmp_path / name)))
        assert summary["updates"] == 4 and summary["total_steps"] == 64 and summary["stop_reason"] == "total_timesteps"
    sequential, overlap, again = (
        rundir.read_jsonl(tmp_path / d / rundir.METRICS) for d in ("sequential", "overlap", "again")
    )
    assert [r["update"] for r in overlap] == [1, 2, 3, 4]
    assert [r["global_step"] for r in overlap] == [16, 32, 48, 64]  # each row: as of its rollout's end
    previous = {"seconds": 0.0, "global_step": 0}
    for row in overlap:  # (each over its rollout's period: the first not over two rollouts, the last not over none)
        assert row["sps_update"] > 0
        assert row["transitions_per_s"] == pytest.approx(row["sps_update"] * row["batch_size"] / 16, rel=0.01)
        # (seconds too, as its global_step and returns: not a rollout later, when the row is written)
        # (within the rounding of a few ms to 0.1 ms; a rollout later would be twice the time)
        wall = row["seconds"] - previous["seconds"]
        assert row["sps_update"] == pytest.approx((row["global_step"] - previous["global_step"]) / wall, rel=0.15)
        assert row["sps"] == pytest.approx(row["global_step"] / row["seconds"], rel=0.15)
        previous = row
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl"):
        assert overlap[0][key] == sequential[0][key], key
    assert overlap[1]["policy_loss"] != sequential[1]["policy_loss"]
    # Whatever the threads' timing, a seed gives one run.
    assert _without_timing(overlap) == _without_timing(again)
    a, b = (torch.load(rundir.list_checkpoints(tmp_path / d)[-1], weights_only=True) for d in ("overlap", "again"))
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key


def test_overlapped_training_through_local_servers(tmp_path: Path) -> None:
    summary = train(
        Args(
            env="CartPole-v1",
            num_servers=2,
            envs_per_server=1,
            num_steps=16,
            num_minibatches=2,
            total_timesteps=96,
            overlap_update=True,
            run_dir=str(tmp_path),
            **QUIET,
        )
    )
    assert summary["updates"] == 3 and summary["total_steps"] == 96
    assert [r["global_step"] for r in rundir.read_jsonl(tmp_path / rundir.METRICS)] == [32, 64, 96]


def test_an_overlapped_run_stopped_mid_rollout_finishes_the_update_in_flight_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C at the 3rd step of the third rollout: the update of the second rollout is running
    # meanwhile; it is waited for, recorded and checkpointed, with the run as of that rollout's end.
    common = {**_resumable(), "overlap_update": True, "checkpoint_every": 1}

    @contextlib.contextmanager
    def interrupted_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=2 * 8 + 3)

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr("learner.train.open_fleet", interrupted_fleet)
        with pytest.raises(TrainingInterrupted) as stopped:
            train(Args(**common, run_dir=str(run)))
    summary = stopped.value.summary
    assert summary["stop_reason"] == "interrupted"
    assert summary["total_steps"] == 32 and summary["updates"] == 2
    assert [p.name for p in rundir.list_checkpoints(run)] == ["step-0000000016.pt", "step-0000000032.pt"]
    saved = torch.load(rundir.list_checkpoints(run)[-1], weights_only=True)
    assert saved["counters"]["update"] == 2 and saved["update_rng"] is not None

    summary = train(resume_args(run))
    assert summary["total_steps"] == 48 and summary["updates"] == 3
    assert [r["update"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [1, 2, 3]


def test_an_overlapped_update_that_fails_ends_the_run_with_its_error_and_no_checkpoint_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last update (of the third and last rollout) fails half-way, in the background: the run
    # must not end as if it had finished, nor checkpoint the nets it left half-updated.
    from learner import train as train_module

    calls = []
    real_update = train_module.ppo_update

    def failing_third(agent: Agent, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                for p in agent.parameters():
                    p.add_(1000.0)
            raise RuntimeError("update blew up")
        return real_update(agent, *args, **kwargs)

    monkeypatch.setattr(train_module, "ppo_update", failing_third)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="update blew up"):
        train(Args(**_resumable(), overlap_update=True, checkpoint_every=1, run_dir=str(run)))
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"].startswith("error: RuntimeError") and summary["updates"] == 2
    assert [p.name for p in rundir.list_checkpoints(run)] == ["step-0000000016.pt", "step-0000000032.pt"]
    saved = torch.load(rundir.list_checkpoints(run)[-1], weights_only=True)
    assert all(t.abs().max() < 100 for t in saved["model"].values())


def test_overlapped_checkpoints_hold_the_reward_scaler_and_generator_as_of_their_rollout(tmp_path: Path) -> None:
    # The mujoco preset scales rewards; an overlapped run makes the next rollout's batch (which
    # updates the scaler) before the update in flight is checkpointed: the checkpoint must still
    # hold the scaler as of the rollout that update learned from, as a sequential run's does.
    for name, overlap in (("sequential", False), ("overlap", True)):
        train(Args(**_resumable(), overlap_update=overlap, checkpoint_every=1, run_dir=str(tmp_path / name)))
    for step in (16, 32, 48):
        a, b = (
            torch.load(tmp_path / d / "checkpoints" / f"step-{step:010d}.pt", weights_only=True)
            for d in ("sequential", "overlap")
        )
        assert torch.equal(a["reward_scaler"]["rms"]["count"], b["reward_scaler"]["rms"]["count"]), step
        assert a["update_rng"] is None and b["update_rng"] is not None


def test_an_overlapped_run_saved_on_another_kind_of_device_resumes_with_its_shuffling_drawn_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--overlap-update's generator is the device's: a run saved on CUDA (its state 16 bytes) resumed on
    the CPU (5,056), or the other way, starts its shuffling anew instead of failing on the state's size."""
    run = tmp_path / "run"
    # (on the CPU: a CUDA host's --device auto would take CUDA, whose generator's state is the one faked here)
    train(Args(**{**_resumable(), "total_timesteps": 32}, overlap_update=True, device="cpu", run_dir=str(run)))
    last = rundir.list_checkpoints(run)[-1]
    payload = torch.load(last, weights_only=True)
    payload["update_rng"] = torch.zeros(16, dtype=torch.uint8)  # (a CUDA generator's, as saved on a GPU host)
    torch.save(payload, last)
    with caplog.at_level("INFO", logger="learner.train"):
        summary = train(resume_args(run, total_timesteps=48))
    assert summary["total_steps"] == 48
    assert "the run was saved on another kind of device" in caplog.text


def test_a_cuda_device_the_host_lacks_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(
        ValueError, match=r"^--device: cuda:1 was asked for, but this host has 1 CUDA device \(cuda:0\)$"
    ):
        pick_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"this host has 2 CUDA devices \(cuda:0 to cuda:1\)$"):
        pick_device("cuda:2")


def test_args_that_mean_nothing_are_refused_or_fit_the_backend() -> None:
    with pytest.raises(ValueError, match=r"--stop-at-return: expected a finite number, or inf \(never\), got nan"):
        Args(stop_at_return=float("nan"))
    # The gym backend has no servers to split the envs over
    assert Args(backend="gym", num_envs=3).local_layout() == (1, 3)
    with pytest.raises(ValueError, match="do not split evenly over --num-servers 2"):
        Args(num_envs=3)


def test_options_that_do_not_apply_are_said_to_be_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=4, total_timesteps=8, action_bounds="squash")
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        train(dataclasses.replace(args, run_dir=str(tmp_path / "run"), hang_timeout=5.0))
    assert "--action-bounds: applies to Box actions, not Discrete(2); ignored" in caplog.text
    assert "--hang-timeout: applies to env servers this command starts, not in-process envs; ignored" in caplog.text
    assert rundir.read_json(tmp_path / "run" / rundir.CONFIG)["policy"] == "MLP 64,64"


def test_without_a_terminal_a_progress_line_is_printed_now_and_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner import train as train_module

    monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 0.0)  # (every update; 60 s in use)
    train(Args(**{**_resumable(), "progress": None}, run_dir=str(tmp_path / "r")))  # (pytest's stderr: no terminal)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.partition(",")[0] for line in lines] == ["step 16/48 (33%)", "step 32/48 (67%)", "step 48/48 (100%)"]
    assert " SPS, mean return " in lines[0] and lines[0].endswith(" s left")  # (its ETA, until the last)
    assert lines[-1].endswith(" s") and "left" not in lines[-1]
    train(Args(**_resumable(), run_dir=str(tmp_path / "quiet")))  # (--no-progress: none)
    assert "step " not in capsys.readouterr().out


def test_squashing_unbounded_actions_is_refused_naming_the_option_before_the_run_dir(tmp_path: Path) -> None:
    args = Args(**clock(3, action="box"), backend="gym", wrappers="clip-action", action_bounds="squash")
    with pytest.raises(ValueError, match=r"^--action-bounds squash: maps actions onto their bounds, but these envs'"):
        train(dataclasses.replace(args, run_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_a_rollout_that_cannot_fit_in_memory_is_refused_before_the_run_dir_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused at the start, not killed by the kernel once the storage is touched (or failing at its allocation
    with torch's "DefaultCPUAllocator: can't allocate memory"): 1024 Atari envs x 128 steps need over 12 GB."""
    from learner import train as train_module

    said: list[int] = []

    def little(device: torch.device) -> tuple[int, str]:
        said.append(0)
        return 100, "this machine"

    monkeypatch.setattr(train_module, "available_memory", little)
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=16, run_dir=str(tmp_path / "run"))
    with pytest.raises(
        OptionError,
        match=r"^--num-steps 16 x 2 envs: a rollout of \(2,\) float32 observations and its update need at least 3\.1 kB on "
        r"cpu, and this machine has 0\.1 kB available: lower --num-steps or the number of envs \(or free memory\)$",
    ):
        train(args)
    assert said and not (tmp_path / "run").exists()
    # What it counts: the rollout's observations, the update's copy of them, a minibatch of them as float32.
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    hp = dataclasses.replace(resolve_ppo(args, space, gym.spaces.Discrete(6)), num_steps=128, num_minibatches=4)
    stored = train_module._obs_storage(space)
    assert stored == ((4, 84, 84), torch.uint8)  # (images as the bytes they are)
    monkeypatch.setattr(train_module, "available_memory", lambda device: (12_000_000_000, "this machine"))
    with pytest.raises(OptionError, match=r"need at least 12\.03 GB on cpu, and this machine has 12\.00 GB available"):
        train_module._check_rollout_memory(hp, 1024, *stored, torch.device("cpu"))
    monkeypatch.setattr(train_module, "available_memory", lambda device: (12_100_000_000, "this machine"))
    train_module._check_rollout_memory(hp, 1024, *stored, torch.device("cpu"))  # (fits)
    monkeypatch.setattr(train_module, "available_memory", lambda device: None)  # (unknown: not refused)
    train_module._check_rollout_memory(hp, 1 << 20, *stored, torch.device("cpu"))


def test_available_memory_is_the_machines_or_its_cgroups_if_less(tmp_path: Path) -> None:
    from learner.device import available_memory

    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(
        "MemTotal: 16000000 kB\nMemAvailable: 7000000 kB\nSwapFree: 1000000 kB\n"
    )
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/box/job\n")
    cpu = torch.device("cpu")
    assert available_memory(cpu, str(tmp_path)) == (8_192_000_000, "this machine (with its free swap)")
    job = tmp_path / "sys" / "fs" / "cgroup" / "box" / "job"
    job.mkdir(parents=True)
    (job / "memory.max").write_text("max\n")
    (job.parent / "memory.max").write_text("4000000000\n")  # (a parent's limit holds too)
    # Its page cache (file) can be reclaimed: not counted as held.
    (job.parent / "memory.stat").write_text("anon 1000000000\nfile 2500000000\nshmem 500000000\n")
    assert available_memory(cpu, str(tmp_path)) == (2_500_000_000, "this process's cgroup (its memory limit)")
    (job.parent / "memory.max").write_text("max\n")
    assert available_memory(cpu, str(tmp_path)) == (8_192_000_000, "this machine (with its free swap)")
    (tmp_path / "proc" / "meminfo").unlink()
    assert available_memory(cpu, str(tmp_path)) is None
    assert available_memory(torch.device("meta"), str(tmp_path)) is None


@pytest.mark.parametrize("namespaced", [False, True])
def test_available_memory_reads_a_cgroup_v1_memory_limit(tmp_path: Path, namespaced: bool) -> None:
    """``docker run --memory 4g`` on a cgroup v1 host (this project's CI machines are): memory.limit_in_bytes less
    what its processes hold, counted over its children (was: only cgroup v2's memory.max was read). In a container
    without a cgroup namespace, the host's tree; with one, its own cgroup is the mount's root."""
    from learner.cgroups import cgroup_memory_left
    from learner.device import available_memory

    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text("MemAvailable: 7000000 kB\nSwapFree: 0 kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text("5:memory:/docker/0123abcd\n4:cpu,cpuacct:/docker/0123abcd\n")
    memory = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    box = memory if namespaced else memory / "docker" / "0123abcd"
    box.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # (the host's: none)
    (memory / "memory.stat").write_text("total_rss 9000000000\n")
    (box / "memory.limit_in_bytes").write_text("4000000000\n")
    # rss and shmem are the cgroup's own, total_*: with its children's; cache can be reclaimed.
    (box / "memory.stat").write_text("cache 2000000000\nrss 1\nshmem 2\ntotal_rss 1000000000\ntotal_shmem 500000000\n")
    cpu = torch.device("cpu")
    assert cgroup_memory_left(str(tmp_path)) == 2_500_000_000
    assert available_memory(cpu, str(tmp_path)) == (2_500_000_000, "this process's cgroup (its memory limit)")
    (box / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_left(str(tmp_path)) is None
    assert available_memory(cpu, str(tmp_path)) == (7_168_000_000, "this machine (with its free swap)")


def test_actions_no_policy_takes_are_refused_before_the_run_dir_is_made(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^action_space: expected Discrete, MultiDiscrete, MultiBinary or a 1-d"):
        train(Args(**clock(3, action="tuple"), backend="gym", run_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_norm_obs_where_it_does_not_apply_is_said_to_be_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = Args(env="FrozenLake-v1", backend="gym", num_envs=2, num_steps=8)
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        train(dataclasses.replace(args, total_timesteps=16, norm_obs=True, run_dir=str(tmp_path / "run"), **QUIET))
    assert "--norm-obs: applies to vector (Box) observations, not Discrete(16) ones; ignored" in caplog.text


def test_ram_bytes_going_raw_into_the_mlp_are_warned_of_until_norm_obs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("ale_py")
    args = Args(env="ALE/Pong-v5", env_kwargs={"obs_type": "ram"}, backend="gym", num_envs=1, num_steps=4, **QUIET)
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        train(dataclasses.replace(args, total_timesteps=4, run_dir=str(tmp_path / "raw")))
        assert "observations are uint8 values of up to 255 (Box(0, 255, (128,), uint8)), which the MLP" in caplog.text
        caplog.clear()
        train(dataclasses.replace(args, total_timesteps=4, norm_obs=True, run_dir=str(tmp_path / "scaled")))
    assert "which the MLP gets as they are" not in caplog.text


def test_a_dicts_integer_vector_keys_going_raw_into_the_mlp_are_warned_of_until_norm_obs() -> None:
    # A goal env's Dict with a RAM-like key (uint8 bytes up to 255) beside a float vector and a camera: the MLP
    # gets those bytes as they are, as it would a Box of them; --norm-obs scales the Dict's vector keys.
    from learner.train import _raw_integer_observations

    space = gym.spaces.Dict(
        {
            "camera": gym.spaces.Box(0, 255, (36, 36, 3), np.uint8),  # (the CNN's: scaled to [0, 1])
            "grid": gym.spaces.Box(0, 3, (2, 2), np.int8),  # (small cells: no warning)
            "ram": gym.spaces.Box(0, 255, (128,), np.uint8),
            "state": gym.spaces.Box(-1, 1, (3,), np.float32),
        }
    )
    said = _raw_integer_observations(space, False, norm_obs=False)
    assert said.startswith("observations['ram'] are uint8 values of up to 255 (Box(0, 255, (128,), uint8)), which the")
    assert _raw_integer_observations(space, False, norm_obs=True) == ""
    assert (
        _raw_integer_observations(gym.spaces.Dict({"camera": space["camera"], "grid": space["grid"]}), False, False)
        == ""
    )


# -- envs that give nothing to learn from, episodes cut short ----------------------------------------------------


def test_a_run_whose_every_env_fails_stops_with_an_error_naming_the_envs_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every reset raises: no env ever gives a transition, so after 3 such rollouts in a row the run stops with
    an error (not as done, at --total-timesteps), naming what the envs raised; the run dir is as after any error."""
    run = tmp_path / "run"
    args = Args(
        env="tests.envs:FaultyEnv",
        env_kwargs={"raise_in_reset": 0, "fault_env": -1},
        backend="gym",
        num_envs=2,
        num_steps=4,
        total_timesteps=100_000,
        run_dir=str(run),
        **QUIET,
    )
    with caplog.at_level(logging.WARNING, logger="learner.train"), pytest.raises(NothingToLearnError) as stopped:
        train(args)
    message = str(stopped.value)
    said = [r.getMessage() for r in caplog.records if r.name == "learner.train" and "out of order" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("env 0 is out of order (its reset failed; tried again at each step)")
    assert message.startswith(
        "no env gave a transition in 3 rollouts in a row: nothing to learn from, the run stops; the envs reported: "
        "reset: RuntimeError: reset failed on purpose (env "
    ), message
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"] == f"error: NothingToLearnError: {message}"
    # The two rollouts before it skipped their updates (no metrics row, no checkpoint of nets that learned
    # nothing): the run is as before its first update, as a run stopped then is.
    assert summary["updates"] == 0 and summary["total_steps"] == 0
    assert rundir.read_jsonl(run / rundir.METRICS) == [] and rundir.list_checkpoints(run) == []
    assert summary["episodes_cut"] == summary["env_steps_lost"] == summary["env_errors"] == 0  # (as of then)
    # A budget of fewer rollouts than that, all empty: an error too, not a run done at --total-timesteps.
    short = dataclasses.replace(args, total_timesteps=8, run_dir=str(tmp_path / "short"))
    with pytest.raises(NothingToLearnError, match=r"^no env gave a transition in the run's rollout: nothing to learn"):
        train(short)


def test_a_rollout_without_a_transition_skips_its_update_and_its_counts_go_to_the_next(tmp_path: Path) -> None:
    """Every env raises in its first 4 steps (each followed by its reset): the first two rollouts have nothing
    to learn from, so no
    update, no metrics row and no checkpoint (was: an "update" of an empty batch, recorded and checkpointed);
    the first update's row counts their env errors."""
    run = tmp_path / "run"
    env_kwargs = {"raise_from": 1, "raise_until": 5, "fault_env": -1}
    args = Args(env="tests.envs:FaultyEnv", env_kwargs=env_kwargs, backend="gym", num_envs=2, num_steps=4)
    summary = train(dataclasses.replace(args, total_timesteps=32, checkpoint_seconds=0.0, run_dir=str(run), **QUIET))
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [(r["global_step"], r["batch_size"] > 0) for r in rows] == [(24, True), (32, True)]
    assert rows[0]["env_errors"] == summary["env_errors"] == 8 and rows[1]["env_errors"] == 0
    assert summary["updates"] == 2 and [p.name for p in rundir.list_checkpoints(run)] == [
        "step-0000000024.pt",
        "step-0000000032.pt",
    ]


def test_learner_train_stopped_by_an_error_says_how_to_go_on_from_its_last_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a Ctrl-C does: the error (here: nothing to learn from, every env raising once its first episode has
    ended), then the checkpoint a resumed run starts from and the command, for once the cause is mended
    (servers back, the env fixed)."""
    from learner.cli import main

    run = tmp_path / "run"
    failing = '{"raise_in_reset": 1, "fault_env": -1, "length": 8}'  # (2 rollouts, then every reset raises)
    argv = ["train", "--env", "tests.envs:FaultyEnv", "--env-kwargs", failing]
    argv += ["--backend", "gym", "--num-envs", "2", "--num-steps", "4", "--total-timesteps", "100000"]
    assert main([*argv, "--run-dir", str(run), "--no-progress", "--no-plot", "--no-tensorboard"]) == 1
    err = capsys.readouterr().err
    assert "learner train: error: no env gave a transition in 3 rollouts in a row" in err
    assert err.rstrip().endswith(
        f"  once that is mended, continue from its last checkpoint, step-0000000016.pt, with: learner train --resume {run}"
    ), err
    # An error before the session started (its servers not found): `--resume DIR` alone would not take this
    # command's options (config.json is rewritten once the envs are up), so no such hint.
    resumed = ["train", "--resume", str(run), "--backend", "remote", "--servers", "127.0.0.1:9"]
    assert main([*resumed, "--connect-timeout", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "learner train: error: env server 127.0.0.1:9" in err and "once that is mended" not in err, err


def test_an_env_that_raises_on_an_episodes_first_step_cuts_it_and_each_update_counts_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """FaultyEnv of 3-step episodes raises in its 4th step: the first of its second episode (next-step
    autoreset: step 4 of the rollout resets it). That episode is cut short; metrics.jsonl counts it in the
    update whose rollout it was cut in (per update, as env_steps_lost), summary.json in the run's total."""
    run = tmp_path / "run"
    args = Args(
        env="tests.envs:FaultyEnv",
        env_kwargs={"raise_at": 4, "length": 3, "fault_env": -1},
        backend="gym",
        num_envs=1,
        num_steps=8,
        total_timesteps=24,
        run_dir=str(run),
        **QUIET,
    )
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        summary = train(args)
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["episodes_cut"] for r in rows] == [1, 0, 0]
    assert [r["env_steps_lost"] for r in rows] == [r["env_errors"] for r in rows] == [1, 0, 0]
    assert summary["episodes_cut"] == summary["env_steps_lost"] == summary["env_errors"] == 1
    assert rows[0]["transitions_per_s"] < rows[0]["sps_update"]  # (the lost step was no transition)
    said = [r.getMessage() for r in caplog.records if "raised (its episode was cut short" in r.getMessage()]
    assert len(said) == 1 and "step 4 failed on purpose" in said[0] and "(1 env error in this run so far" in said[0]


def test_an_env_error_of_what_the_env_returned_says_returned(caplog: pytest.LogCaptureFixture) -> None:
    from env_server.ratelimit import LogBudget
    from learner.train import _say_env_error

    record = "step: TypeError: step() returned reward None: expected a real number"
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        _say_env_error(LogBudget(60), 1, 2, {"env_error": ["", "", record]})
    assert caplog.records[0].getMessage() == (
        f"env 2 returned what cannot be used (its episode was cut short, and the env reset): {record} (1 env error "
        "in this run so far; one such line a minute at most)"
    )


def test_a_full_disk_stops_the_run_with_one_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint that cannot be written (ENOSPC; torch's own writer raises RuntimeError) ends the run
    with the file, the reason and the room left, not a traceback; the last whole checkpoint stands."""
    import errno

    from learner import train as train_module
    from learner.cli import main

    written: list[int] = []

    def save_until_full(run_dir: Any, step: int, payload: Any, keep: int = 3) -> Path:
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(step)
        return original(run_dir, step, payload, keep)

    original = train_module.save_checkpoint
    monkeypatch.setattr(train_module, "save_checkpoint", save_until_full)
    run = tmp_path / "r"
    argv = ["train", "--env", "tests.envs:ClockEnv", "--backend", "gym", "--num-envs", "1", "--num-steps", "4"]
    argv += ["--total-timesteps", "16", "--checkpoint-seconds", "0", "--run-dir", str(run), "--no-progress"]
    assert main([*argv, "--no-plot", "--no-tensorboard"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"learner train: error: cannot write {run / 'checkpoints' / 'step-0000000008.pt'}: No space left" in err
    assert " MB free there" in err and "stopped during an update" not in err
    assert [p.name for p in rundir.list_checkpoints(run)] == ["step-0000000004.pt"]
    assert rundir.read_json(run / rundir.SUMMARY)["stop_reason"].startswith("error: RunDirWriteError")


def test_a_checkpoint_on_a_full_disk_fails_as_the_os_says_not_as_torch_s_zip_writer_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save writing the file itself turned the short write into "[enforce fail at inline_container.cc:672]
    . unexpected pos 91904 vs 91796", which the run's last line showed as the reason."""
    import errno
    import io

    from learner.checkpoint import save_checkpoint

    class NearlyFull(io.RawIOBase):
        """A file on a disk with 20,000 bytes free, as the kernel writes it: a write that does not fit writes what
        does (a short write, which torch took for its own error), the next fails with ENOSPC."""

        def __init__(self, fd: int) -> None:
            self.fd, self.room = fd, 20_000

        def writable(self) -> bool:
            return True

        def fileno(self) -> int:
            return self.fd

        def write(self, data: Any) -> int:
            if not self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            written = os.write(self.fd, bytes(data)[: self.room])
            self.room -= written
            return written

        def close(self) -> None:
            if not self.closed:
                os.close(self.fd)
            super().close()

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: io.BufferedWriter(NearlyFull(fd)))
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, 8, {"nets": torch.zeros(100_000)})
    assert info.value.errno == errno.ENOSPC
    with (
        pytest.raises(RunDirWriteError, match=r"checkpoints/step-0000000008\.pt: No space left on device; "),
        rundir.writing(rundir.checkpoint_path(tmp_path, 8), torch_save=True),
    ):
        save_checkpoint(tmp_path, 8, {"nets": torch.zeros(100_000)})


@pytest.mark.parametrize("how", ["deleted", "moved"])
@pytest.mark.parametrize("tensorboard", [False, True])
def test_a_run_dir_deleted_or_moved_mid_run_stops_it_and_is_not_made_anew(
    how: str, tensorboard: bool, tmp_path: Path
) -> None:
    """Rows went to the deleted (or moved) metrics.jsonl without a word, and the run dir was made anew with a
    checkpoint and summary.json alone (no config.json, no metrics: no run to resume or plot); without
    TensorBoard the run even ended as finished, exit 0."""
    run = tmp_path / "r"
    updates = []

    def take_it_away(row: dict[str, Any]) -> None:
        updates.append(row)
        if len(updates) == 2:
            shutil.rmtree(run) if how == "deleted" else run.rename(tmp_path / "elsewhere")

    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=64, checkpoint_seconds=0.0)
    args = dataclasses.replace(args, run_dir=str(run), tensorboard=tensorboard, plot=True)
    with pytest.raises(
        RunDirWriteError,
        match=f"^cannot write {re.escape(str(run))}/.*: .* is gone \\(deleted or moved while the run ran\\)$",
    ):
        train(args, on_update=take_it_away)
    assert not run.exists() and len(updates) == 2
    assert (how == "moved") == (tmp_path / "elsewhere" / rundir.CONFIG).exists()


def test_a_new_seed_on_resume_is_said_to_change_only_the_envs_reset_seeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train(Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=4, run_dir=str(tmp_path / "r")))
    resume_args(tmp_path / "r", seed=1, total_timesteps=8)
    assert "--seed" not in caplog.text  # (the run's own)
    assert resume_args(tmp_path / "r", seed=7).seed == 7
    assert "--seed 7: a resumed run draws from its checkpoint's RNG states (run seed 1)" in caplog.text


def test_a_resume_goes_on_from_the_last_readable_checkpoint_setting_damaged_newer_ones_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Atomic writes rule out half a checkpoint, not a damaged disk or copy: the newest one torch cannot
    read is warned of and renamed *.unreadable (its step number would outlive the good ones' pruning)."""
    run = tmp_path / "r"
    train(Args(**{**_resumable(), "total_timesteps": 32}, checkpoint_every=1, run_dir=str(run)))
    newest = rundir.list_checkpoints(run)[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    summary = train(resume_args(run, total_timesteps=48))
    assert summary["total_steps"] == 48
    assert "the file is truncated or corrupt" in caplog.text and "trying the checkpoint before it" in caplog.text
    assert newest.with_name(f"{newest.name}.unreadable").is_file()
    assert [p.name for p in rundir.list_checkpoints(run)] == [f"step-{s:010d}.pt" for s in (16, 32, 48)]
    assert [r["global_step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [16, 32, 48]


def test_config_json_keeps_each_earlier_sessions_record_through_resumes(tmp_path: Path) -> None:
    run = tmp_path / "r"
    train(Args(**{**_resumable(), "total_timesteps": 16}, run_dir=str(run)))
    train(resume_args(run, total_timesteps=32))
    train(resume_args(run, total_timesteps=48, update_epochs=2))
    config = rundir.read_json(run / rundir.CONFIG)
    assert config["resumed_at_step"] == 32 and config["args"]["update_epochs"] == 2
    first, second = config["earlier_sessions"]
    assert (first["resumed_at_step"], second["resumed_at_step"]) == (None, 16)
    assert "earlier_sessions" not in first and "earlier_sessions" not in second  # (each kept once, in order)
    assert first["args"]["update_epochs"] == second["args"]["update_epochs"] == 3
    assert all(s["started"] and s["versions"] for s in (first, second))
    # The progress display is the session's, not the run's: not taken over from its config.json.
    assert first["args"]["progress"] is False and resume_args(run).progress is None


def test_a_run_recorded_by_an_older_version_with_values_this_one_refuses_still_resumes_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Older versions ignored --tls for the servers a run started and took a negative --vf-coef: recorded
    so, such a run resumes (TLS for local servers dropped; an override mends the rest) and evaluates."""
    from learner.cli import main

    run = tmp_path / "r"
    train(Args(**{**_resumable(), "total_timesteps": 16}, run_dir=str(run)))
    config = rundir.read_json(run / rundir.CONFIG)
    config["args"].update(tls=True, tls_server_name="", vf_coef=-0.5)
    rundir.write_json(run / rundir.CONFIG, config)
    for path in rundir.list_checkpoints(run):  # (eval reads the checkpoint's copy)
        state = torch.load(path, weights_only=True)
        state["args"].update(tls=True, vf_coef=-0.5)
        torch.save(state, path)
    with pytest.raises(ValueError, match="--vf-coef: expected a value >= 0"):
        resume_args(run, total_timesteps=32)
    resumed = resume_args(run, total_timesteps=32, vf_coef=0.5)
    assert (resumed.tls, resumed.tls_server_name, resumed.vf_coef) == (False, None, 0.5)
    assert main(["eval", str(run), "--backend", "gym", "--episodes", "1"]) == 0, capsys.readouterr().err


def test_a_run_moved_off_running_servers_keeps_their_recorded_wrappers(
    tmp_path: Path, start_servers: StartServers
) -> None:
    box = {"length": 3, "action": "box"}
    (address,) = start_servers("tests.envs:ClockEnv", 1, 2, env_kwargs=box, server_args=["--wrappers", "clip-action"])
    run = tmp_path / "r"
    train(Args(**QUIET, servers=address, num_steps=4, total_timesteps=8, run_dir=str(run)))
    # --like: the same on envs this command starts; with another env, none of the servers' options.
    like = like_args(run, backend="gym", env=CLOCK_ENV)  # (named again: see test_eval)
    assert (like.servers, like.wrappers, like.env_kwargs, like.resume) == (None, "clip-action", box, None)
    other = like_args(run, backend="gym", env="CartPole-v1")
    assert (other.env, other.wrappers, other.env_kwargs) == ("CartPole-v1", "auto", {})
    same = like_args(run, backend="gym", env=CLOCK_ENV)  # (the same env given: as if not)
    assert (same.wrappers, same.env_kwargs, same.learning_rate) == ("clip-action", box, like.learning_rate)
    assert like.learning_rate is not None  # (as the run resolved it)
    moved = resume_args(run, backend="gym", env=CLOCK_ENV, env_kwargs=box, total_timesteps=16)
    assert (moved.servers, moved.wrappers) == (None, "clip-action")
    assert train(moved)["total_steps"] == 16
    # The servers' env kwargs too, as they said them (EnvSpec.env_kwargs), unless given.
    assert rundir.read_json(run / rundir.CONFIG)["envs"]["env_kwargs"] == box
    moved = resume_args(run, backend="gym", env=CLOCK_ENV, total_timesteps=24)
    assert moved.env_kwargs == box and train(moved)["total_steps"] == 24


def test_a_run_of_an_older_version_moved_off_its_servers_says_their_env_kwargs_are_unknown(
    tmp_path: Path, start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """Same spaces, maybe another task (CartPole's sutton_barto_reward): not taken for none without a word."""
    (address,) = start_servers("CartPole-v1", 1, 2, env_kwargs={"sutton_barto_reward": True})
    run = tmp_path / "r"
    train(Args(**QUIET, servers=address, num_steps=4, total_timesteps=8, run_dir=str(run)))
    config = rundir.read_json(run / rundir.CONFIG)
    del config["envs"]["env_kwargs"], config["envs"]["max_episode_steps"]  # (as an older version wrote it)
    rundir.write_json(run / rundir.CONFIG, config)
    with caplog.at_level(logging.WARNING, logger="learner"):
        moved = resume_args(run, backend="gym", total_timesteps=16)
    assert moved.servers is None and moved.env_kwargs == {}
    assert (
        f"--resume: the run in {run} trained on running env servers ({address}), whose env kwargs and time limit it "
        "does not record; the envs this command starts get env kwargs {} and the env's own time limit: if those "
        "servers were started with other kwargs, give them as --env-kwargs"
    ) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="learner"):
        resume_args(run, backend="gym", env_kwargs={"sutton_barto_reward": True}, total_timesteps=16)
        like_args(run, backend="gym", env="Acrobot-v1")  # (another env: the servers' kwargs are moot)
    assert "does not record" not in caplog.text


def test_in_process_envs_record_their_time_limit_and_env_kwargs(tmp_path: Path) -> None:
    """config.json's envs (and the checkpoints' "served"): as for servers, which say theirs."""
    for limit, recorded in ((None, 500), (7, 7)):
        run = tmp_path / f"limit-{limit}"
        argv: dict[str, Any] = {
            "env": "CartPole-v1",
            "env_kwargs": {"sutton_barto_reward": True},
            "max_episode_steps": limit,
        }
        train(Args(**QUIET, **argv, backend="gym", num_envs=2, num_steps=4, total_timesteps=8, run_dir=str(run)))
        envs = rundir.read_json(run / rundir.CONFIG)["envs"]
        assert (envs["max_episode_steps"], envs["env_kwargs"]) == (recorded, {"sutton_barto_reward": True})


def test_a_run_moved_onto_running_servers_drops_the_options_of_the_servers_it_started(tmp_path: Path) -> None:
    train(
        Args(
            **clock(3),
            num_servers=1,
            num_envs=1,
            num_steps=4,
            total_timesteps=4,
            hang_timeout=90.0,
            step_delay_ms=1.0,
            run_dir=str(tmp_path / "r"),
        )
    )
    moved = resume_args(tmp_path / "r", servers="127.0.0.1:1")
    assert (moved.hang_timeout, moved.step_delay_ms, moved.env_kwargs, moved.num_envs) == (None, 0.0, {}, None)


def test_a_full_disk_under_metrics_jsonl_stops_the_run_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The row a failed write left in the file's buffer fails again at close: said once, not as a traceback."""
    import builtins

    from learner import train as train_module
    from learner.cli import main

    def full_metrics(path: Any, *args: Any, **kwargs: Any) -> Any:
        return builtins.open("/dev/full" if str(path).endswith(rundir.METRICS) else path, *args, **kwargs)

    monkeypatch.setattr(train_module, "open", full_metrics, raising=False)
    monkeypatch.setattr(rundir, "still_there", lambda run_dir, metrics: None)  # (its metrics.jsonl is /dev/full)
    run = tmp_path / "r"
    argv = ["train", "--env", "tests.envs:ClockEnv", "--backend", "gym", "--num-envs", "1", "--num-steps", "4"]
    argv += ["--total-timesteps", "16", "--run-dir", str(run), "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"learner train: error: cannot write {run / rundir.METRICS}: No space left on device" in err


def test_a_full_disk_under_the_tensorboard_events_stops_the_run_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TensorBoard writes from a thread of its own: its error was printed as that thread's traceback, then
    raised again by the next scalar and by the close, as two more."""
    import errno

    from tensorboard.summary.writer import record_writer

    from learner.cli import main

    write = record_writer.RecordWriter.write
    calls = []

    def fill_up(self: Any, data: bytes) -> None:
        calls.append(len(data))
        if len(calls) > 30:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", fill_up)
    run = tmp_path / "r"
    argv = ["train", "--env", "tests.envs:ClockEnv", "--backend", "gym", "--num-envs", "1", "--num-steps", "4"]
    argv += ["--total-timesteps", "400", "--run-dir", str(run), "--no-progress", "--no-plot"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    events = next(run.glob("events.out.tfevents.*"))
    assert f"learner train: error: cannot write {events}: No space left on device" in err, err
    assert rundir.read_json(run / rundir.SUMMARY)["stop_reason"].startswith("error: RunDirWriteError")


def test_a_run_resumed_from_a_checkpoint_file_goes_on_in_its_run_dir(tmp_path: Path) -> None:
    """train(Args(resume=FILE)) (the API; the CLI's --resume takes run dirs): the run dir the file is in."""
    run = tmp_path / "r"
    args = Args(**{**_resumable(), "total_timesteps": 32}, checkpoint_every=1, run_dir=str(run))
    train(args)
    first = rundir.list_checkpoints(run)[0]
    summary = train(dataclasses.replace(args, run_dir=None, resume=str(first), total_timesteps=48))
    assert summary["total_steps"] == 48 and summary["run_dir"] == str(run)
    assert [r["global_step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [16, 32, 48]
    elsewhere = tmp_path / "copy.pt"
    shutil.copy(first, elsewhere)
    with pytest.raises(ValueError, match=r"resume: .*copy\.pt is a checkpoint outside a run dir's checkpoints/"):
        train(dataclasses.replace(args, run_dir=None, resume=str(elsewhere)))


def test_resuming_from_a_checkpoint_file_that_does_not_exist_says_so_and_what_is_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # learner train --resume RUN/checkpoints/step-N.pt, a step never checkpointed (or pruned by --keep-checkpoints):
    # "--resume: expected a run dir holding config.json, but RUN/checkpoints/step-N.pt/config.json does not exist",
    # as if the file were to be a run dir. It says the file does not exist, the run dir's checkpoints, and that the
    # run dir itself goes on from its latest; the API's train(Args(resume=FILE)) says so too.
    from learner.cli import main

    run = tmp_path / "r"
    args = Args(**{**_resumable(), "total_timesteps": 32}, checkpoint_every=1, run_dir=str(run))
    train(args)
    missing = run / rundir.CHECKPOINTS / "step-0000000999.pt"
    said = (
        f"the checkpoint file {missing} does not exist; {run / rundir.CHECKPOINTS} has step-0000000016.pt, "
        f"step-0000000032.pt: pass one of them, or the run dir {run} for its latest"
    )
    with pytest.raises(FileNotFoundError) as refused:
        resume_args(missing)
    assert str(refused.value) == f"--resume: {said}"
    with pytest.raises(FileNotFoundError) as refused:
        train(dataclasses.replace(args, run_dir=None, resume=str(missing)))
    assert str(refused.value) == said
    with pytest.raises(SystemExit) as exited:
        main(["train", "--resume", str(missing)])
    assert exited.value.code == 2 and f"learner train: error: --resume: {said}" in capsys.readouterr().err
    # No run dir there either: said so.
    with pytest.raises(FileNotFoundError) as refused:
        resume_args(tmp_path / "none" / rundir.CHECKPOINTS / "step-0000000016.pt")
    assert str(refused.value).endswith(f"step-0000000016.pt does not exist; {tmp_path / 'none'} does not exist either")


def test_a_run_resumed_from_an_older_checkpoint_file_sets_the_newer_ones_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resumed from a checkpoint before its run dir's latest, a run abandons what came after it: the newer
    checkpoints are renamed *.abandoned (else pruning deletes the new run's before them, and a later
    --resume of the run dir goes on from them), and their metrics rows go."""
    run = tmp_path / "r"
    args = Args(**{**_resumable(), "total_timesteps": 64, "keep_checkpoints": 3}, checkpoint_every=1, run_dir=str(run))
    train(args)
    assert [rundir.checkpoint_step(p) for p in rundir.list_checkpoints(run)] == [32, 48, 64]
    # A best.pt of a step after the one resumed from is the abandoned run's too (its nets, and its bar).
    best = run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
    state = load_checkpoint(rundir.list_checkpoints(run)[-1])  # (as a run writes it at a new best of step 64)
    state["counters"]["best_step"], state["counters"]["best_return"] = 64, 1e9
    torch.save(state, best)
    older = rundir.list_checkpoints(run)[0]
    resumed = train(dataclasses.replace(args, run_dir=None, resume=str(older), total_timesteps=48))
    assert f"resume: {older} is of step 32, before the latest checkpoints in {run}" in caplog.text, caplog.text
    assert (
        "the newer ones (step-0000000048.pt, step-0000000064.pt, best.pt, of the run it abandons) are set aside as "
        "step-0000000048.pt.abandoned, step-0000000064.pt.abandoned, best.pt.abandoned, their metrics.jsonl rows past "
        "step 32 dropped"
    ) in caplog.text
    assert resumed["best_return"] != 1e9 and (resumed["best_step"] or 0) <= 48  # (the resumed run's own, if any)
    assert not best.exists() or load_checkpoint(best)["counters"]["best_step"] <= 48
    # (not the abandoned run's step 64, which pruning would keep and a --resume would go on from)
    assert [rundir.checkpoint_step(p) for p in rundir.list_checkpoints(run)] == [32, 48]
    assert (run / rundir.CHECKPOINTS / "step-0000000064.pt.abandoned").is_file()
    assert [r["global_step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [16, 32, 48]
    assert load_checkpoint(run)["counters"]["global_step"] == 48
    summary = train(resume_args(run, total_timesteps=64))  # (on from this run's latest, as its metrics are)
    assert summary["total_steps"] == 64
    assert [r["global_step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [16, 32, 48, 64]
    # Abandoned again from the same file: the first abandoned ones are kept, not overwritten.
    first = (run / rundir.CHECKPOINTS / "step-0000000064.pt.abandoned").read_bytes()
    train(dataclasses.replace(args, run_dir=None, resume=str(older), total_timesteps=48))
    assert "set aside as step-0000000048.pt.abandoned-2, step-0000000064.pt.abandoned-2" in caplog.text
    assert (run / rundir.CHECKPOINTS / "step-0000000064.pt.abandoned").read_bytes() == first
    assert (run / rundir.CHECKPOINTS / "step-0000000064.pt.abandoned-2").is_file()


def test_a_run_resumed_from_its_latest_checkpoint_keeps_a_newer_best_pt(tmp_path: Path) -> None:
    """A run killed after a new best.pt, before its next checkpoint: best.pt is of its own timeline, kept (and its
    bar), whether the run dir or its latest checkpoint file is given."""
    run = tmp_path / "r"
    args = Args(**{**_resumable(), "total_timesteps": 32}, checkpoint_every=1, run_dir=str(run))
    train(args)
    best = run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
    state = load_checkpoint(rundir.list_checkpoints(run)[-1])
    state["counters"]["best_step"], state["counters"]["best_return"] = 40, 1e9  # (written at step 40, then killed)
    torch.save(state, best)
    for total in (48, 64):  # (the run dir; then its latest checkpoint file, step 48's)
        resume = run if total == 48 else rundir.list_checkpoints(run)[-1]
        summary = train(resume_args(resume, total_timesteps=total))
        assert best.is_file() and not list(best.parent.glob("*.abandoned"))
        assert (summary["best_return"], summary["best_step"]) == (1e9, 40)


def test_a_damaged_best_pt_is_set_aside_on_resume_and_the_checkpoint_s_bar_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """best.pt torch cannot read (a damaged disk or copy) does not keep a run with good checkpoints from
    going on: it is renamed best.pt.unreadable, and the bar is the checkpoint's own best mean return."""
    run = tmp_path / "run"
    kwargs = clock(length=3) | {"backend": "gym", "num_envs": 4, "num_steps": 8}
    train(Args(**kwargs, total_timesteps=32 * 8, run_dir=str(run)))
    best_file = run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
    bar = load_checkpoint(run)["counters"]["best_return"]
    assert bar is not None
    best_file.write_bytes(best_file.read_bytes()[: best_file.stat().st_size // 2])
    summary = train(resume_args(str(run), total_timesteps=32 * 10))
    assert summary["total_steps"] == 32 * 10 and summary["best_return"] >= bar
    assert f"{best_file}: expected an envfleet checkpoint, but the file is truncated or corrupt" in caplog.text
    assert f"set aside as best.pt.unreadable: the run goes on with its checkpoint's best mean return ({bar:.2f}" in (
        caplog.text
    )
    assert (run / rundir.CHECKPOINTS / "best.pt.unreadable").is_file()


@pytest.mark.parametrize("write", ["metrics", "unreadable"])
def test_a_run_dir_that_cannot_be_written_on_resume_is_said_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], write: str
) -> None:
    """A read-only or full run dir on --resume: the file, the reason and the room left, not a traceback
    (metrics.jsonl's rows past the checkpoint dropped; a damaged checkpoint set aside)."""
    import errno

    from learner.cli import main

    run = tmp_path / "r"
    train(Args(**{**_resumable(), "total_timesteps": 32}, checkpoint_every=1, run_dir=str(run)))
    newest = rundir.list_checkpoints(run)[-1]

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied")

    if write == "metrics":  # (a row past the checkpoint, of an update the run was killed after: cut off)
        last = rundir.read_jsonl(run / rundir.METRICS)[-1]
        with open(run / rundir.METRICS, "a") as f:
            f.write(json.dumps({**last, "update": last["update"] + 1}) + "\n")
        monkeypatch.setattr(os, "truncate", refused)
        path = run / rundir.METRICS
    else:
        newest.write_bytes(b"")
        monkeypatch.setattr(Path, "rename", refused)
        path = newest
    assert main(["train", "--resume", str(run), "--total-timesteps", "48", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"learner train: error: cannot write {path}: Permission denied" in err, err


def test_a_relative_run_dir_stays_where_it_was_when_the_working_directory_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook's %cd while train() runs (in a thread): the run's files all go where its run dir was
    when it began, and the summary names that folder."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    summary = train(
        Args(**{**_resumable(), "total_timesteps": 48, "plot": True}, checkpoint_every=1, run_dir="run"),
        on_update=lambda row: os.chdir(tmp_path / "b"),
    )
    run = tmp_path / "a" / "run"
    assert list((tmp_path / "b").iterdir()) == []
    assert [rundir.checkpoint_step(p) for p in rundir.list_checkpoints(run)] == [16, 32, 48]
    assert [r["global_step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [16, 32, 48]
    assert (run / rundir.SUMMARY).is_file() and (run / rundir.PLOT).is_file()
    assert summary["run_dir"] == str(run)
    # Resumed by a relative path, likewise.
    monkeypatch.chdir(tmp_path / "a")
    summary = train(resume_args("run", total_timesteps=64), on_update=lambda row: os.chdir(tmp_path / "b"))
    assert summary["run_dir"] == str(run) and list((tmp_path / "b").iterdir()) == []
    assert rundir.checkpoint_step(rundir.list_checkpoints(run)[-1]) == 64


def test_a_plot_that_fails_at_the_run_s_end_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """returns.png is the last thing a run writes: a run dir gone by then (moved, deleted) is said, and
    the run that stopped cleanly is not turned into an error."""
    from learner.records import plot_at_exit

    with plot_at_exit(True) as plotted:
        plotted.append(tmp_path / "gone")
    assert f"no plot written: {tmp_path / 'gone'}: no such run dir" in caplog.text


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({"config.json": '{"my": "settings"}'}, "and its config.json is no run's (it has no 'args' object)"),
        ({"config.json": "[1, 2]", "returns.png": ""}, "and its config.json is no run's"),
        ({"config.json": "{not json"}, "and its config.json cannot be read (Expecting property name"),
        ({"metrics.jsonl": "", "summary.json": "{}"}, "but no config.json"),
    ],
)
def test_a_run_dir_holding_files_that_are_no_run_s_is_refused_and_left_as_it_is(
    tmp_path: Path, files: dict[str, str], why: str
) -> None:
    """Files by a run's names in --run-dir that are no run's (a project's config.json): not taken for a
    run stopped before its first checkpoint and moved to previous/, but refused, naming the folder."""
    run = tmp_path / "proj"
    run.mkdir()
    for name, text in files.items():
        (run / name).write_text(text)
    names = ", ".join(sorted(files))
    with pytest.raises(
        ValueError, match=rf"^--run-dir {run}: expected a new or empty folder, or a run's, but it holds "
    ):
        train(Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=4, run_dir=str(run)))
    with pytest.raises(ValueError) as refused:
        train(Args(**clock(3), backend="gym", num_envs=1, num_steps=4, total_timesteps=4, run_dir=str(run)))
    assert f"it holds {names}, {why}" in str(refused.value) and "pass another --run-dir" in str(refused.value)
    assert sorted(p.name for p in run.iterdir() if p.name != rundir.LOCK) == sorted(files)
    assert all((run / name).read_text() == text for name, text in files.items())


def test_tensorboard_gets_a_fault_tag_from_its_first_fault_on() -> None:
    """A run without faults has no flat-zero faults/ tags; one with a fault has its tag from that update on."""
    from learner.records import write_tensorboard

    class Writer:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

    base = dict.fromkeys(
        ["learning_rate", "clip_coef", "sps", "num_envs", "value_loss", "policy_loss", "entropy", "old_approx_kl"], 0.0
    )
    base.update(dict.fromkeys(["approx_kl", "clipfrac", "explained_variance", "rollout_seconds"], 0.0))
    base.update(dict.fromkeys(["update_seconds", "other_seconds", "sps_update", "transitions_per_s"], 0.0))
    base.update(dict.fromkeys(["env_steps_lost", "env_errors", "envs_unavailable", "episodes_cut"], 0))
    base.update({"faults/failures": 0, "replicas/local-0/steps": 8.0})
    writer, seen = Writer(), set[str]()
    for step, faults in ((8, {}), (16, {"env_errors": 2, "faults/failures": 1}), (24, {})):
        write_tensorboard(writer, {**base, **faults, "global_step": step}, seen)  # type: ignore[arg-type]
    fault_scalars = [(tag, value, step) for tag, value, step in writer.scalars if tag.startswith("faults/")]
    assert fault_scalars == [
        ("faults/env_errors", 2, 16),
        ("faults/failures", 1, 16),
        ("faults/env_errors", 0, 24),
        ("faults/failures", 0, 24),
    ]
    assert [step for tag, _, step in writer.scalars if tag == "replicas/local-0/steps"] == [8, 16, 24]
    # A resumed session goes on with the tags its run started (from the run's metrics.jsonl, as kept).
    from learner.records import fault_tags_started

    rows: list[dict[str, Any]] = [
        {**base, "global_step": 8},
        {**base, "env_errors": 2, "global_step": 16},
        {"global_step": 24},
    ]
    assert fault_tags_started(rows) == {"faults/env_errors"}


@needs_proc
def test_the_metrics_rows_are_on_disk_before_each_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints were fsynced and metrics.jsonl not: after a power cut, a resumed run could lack the rows of
    updates its checkpoint counts, a gap nothing said."""
    synced: list[str] = []
    real_fsync = os.fsync

    def noting(fd: int) -> None:
        with contextlib.suppress(OSError):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", noting)
    run = tmp_path / "r"
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=32, checkpoint_seconds=0.0)
    train(dataclasses.replace(args, run_dir=str(run)))
    checkpoints = [i for i, path in enumerate(synced) if "/checkpoints/.step-" in path]
    assert checkpoints and all(synced[i - 1] == str(run / rundir.METRICS) for i in checkpoints), synced
