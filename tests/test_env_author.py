"""What an env's author may count on, served as under gymnasium's own vector envs: the env gets writeable
actions and reset options, an info value of any type crosses (as its repr where no wire form carries
it, so the step is not lost), and an info key envfleet reserves is refused by name."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Literal, cast

import grpc
import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from env_server import codec
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import RemoteVectorEnv, rundir
from learner.config import Args
from learner.errors import EnvCrashedError, UnusableEnvOutputError, UpdateDivergedError
from learner.evaluate import evaluate
from learner.ppo import observations_usable
from learner.train import Acting, train
from tests.compare import assert_same
from tests.conftest import SpawnServer, on_cuda
from tests.envs import InPlaceEnv

# StepStream (tcp), and the step socket (unix); the unary Step: test_unsendable_infos_are_warned_of_once...
TRANSPORTS = ["tcp", "unix"]


# ---------------------------------------------------------------------------------------------
# Writeable arrays


def test_decode_value_gives_writeable_copies_when_asked() -> None:
    value = codec.encode_value({"a": np.arange(3), "b": (np.ones(2),), "c": [np.zeros(1)]}, pb.Value())
    views = codec.decode_value(value)
    copies = codec.decode_value(value, writeable=True)
    assert not views["a"].flags.writeable  # (the learner's observations: no copy)
    for array in (copies["a"], copies["b"][0], copies["c"][0]):
        assert array.flags.writeable
    copies["a"] += 1
    np.testing.assert_array_equal(codec.decode_value(value)["a"], [0, 1, 2])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_envs_may_change_their_actions_and_reset_options_in_place(start_servers: Any, transport: str) -> None:
    # (they came read-only: "output array is read-only" where SyncVectorEnv's envs clipped fine)
    addresses = start_servers("tests.envs:InPlaceEnv", envs_per_server=2, transport=transport)
    local = gym.vector.SyncVectorEnv([InPlaceEnv] * 2)
    goal = np.zeros(2)
    actions = np.full((2, 2), 0.9, dtype=np.float32)
    with RemoteVectorEnv(addresses) as envs:
        got = envs.reset(seed=0, options={"goal": goal})
        want = local.reset(seed=0, options={"goal": goal.copy()})
        assert_same(got, want, "reset")
        assert got[1]["goal"].tolist() == [[1.0, 1.0], [2.0, 2.0]]  # (one options dict for both envs, as locally)
        for t in range(4):
            assert_same(envs.step(actions), local.step(actions.copy()), f"step {t}")
    assert (actions == np.float32(0.9)).all() and (goal == 0).all()  # (the learner's own arrays: untouched)
    local.close()


def test_same_step_final_observations_and_infos_are_writeable(start_servers: Any) -> None:
    addresses = start_servers("tests.envs:InPlaceEnv", envs_per_server=2, server_args=["--autoreset-mode", "SameStep"])
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        for _ in range(3):  # (episodes of 3 steps)
            *_, infos = envs.step(np.zeros((2, 2), dtype=np.float32))
    assert infos["_final_obs"].all()
    for final_obs in infos["final_obs"]:
        assert final_obs.flags.writeable  # (as gymnasium's)
    assert infos["final_info"]["seen"].flags.writeable


# ---------------------------------------------------------------------------------------------
# Info values no wire form carries


def test_encode_value_sends_what_unsendable_gives_for_what_it_cannot_send() -> None:
    seen: list[tuple[str, str]] = []

    def as_repr(value: Any, where: str, reason: str) -> Any:
        seen.append((where, reason))
        return repr(value)

    value = {"o": np.array([object, {1, 2}, 1 << 70, {2: "b"}, np.complex64(1j)], dtype=object), "n": np.arange(2)}
    decoded = codec.decode_value(codec.encode_value(value, pb.Value(), "infos", unsendable=as_repr))
    assert decoded["o"].tolist() == [repr(object), "{1, 2}", repr(1 << 70), "{2: 'b'}", repr(np.complex64(1j))]
    np.testing.assert_array_equal(decoded["n"], [0, 1])
    assert [where for where, _ in seen] == [f"infos['o'][{i}]" for i in range(5)]
    assert "dict key 2 is a int; only str keys can be sent" in seen[3][1]
    with pytest.raises(codec.CodecError, match=r"infos\['o'\]\[0\]: cannot send a value of type builtins.type"):
        codec.encode_value(value, pb.Value(), "infos")


def _check_unsendable_infos(infos: dict[str, Any], t: int) -> None:
    """The infos of UnsendableInfoEnv's step ``t`` (over 2 envs), as the learner gets them."""
    assert infos["obj"].tolist() == [f"Opaque({t})"] * 2
    assert infos["s"].tolist() == ["{1, 2}"] * 2
    # (gymnasium's vector env spread the env's dict {1: "a"} over the envs: sent with its keys as str)
    assert infos["d"]["1"].tolist() == ["a", "a"] and infos["d"]["_1"].all()
    assert infos["c"].tolist() == [repr(np.complex128(1 + 2j))] * 2
    assert infos["ok"].tolist() == [t, t]


@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["plain", "fault-tolerant"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_info_values_no_wire_form_carries_come_as_their_repr(
    start_servers: Any, transport: str, fault_tolerant: bool
) -> None:
    # (the whole server's step failed INTERNAL: under fault tolerance, lost and rejoined for ever)
    addresses = start_servers("tests.envs:UnsendableInfoEnv", envs_per_server=2, transport=transport)
    with RemoteVectorEnv(addresses, fault_tolerant=fault_tolerant) as envs:
        envs.reset(seed=0)
        for t in range(1, 4):
            *_, infos = envs.step(np.zeros(2, dtype=np.int64))
            assert "env_unavailable" not in infos
            _check_unsendable_infos(infos, t)


def test_unsendable_infos_are_warned_of_once_per_key_and_the_unary_step_sends_them(spawn_server: SpawnServer) -> None:
    server = spawn_server("tests.envs:UnsendableInfoEnv", 2)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(), timeout=5).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=5)
        step = pb.StepRequest(session_id=session)
        codec.encode_value(np.zeros(2, dtype=np.int64), step.actions, "actions")
        for t in range(1, 4):
            _check_unsendable_infos(codec.decode_value(stub.Step(step, timeout=5).infos), t)
    logs = server.logs()
    for key, what, done in (
        ("'obj'", "a tests.envs.Opaque", "sent as its repr"),
        ("'s'", "a builtins.set", "sent as its repr"),
        ("'d'", "a builtins.dict", "sent with its keys as str"),
        ("'c'", "an array of dtype complex128", "sent as a str array of its items' reprs"),
    ):
        lines = [line for line in logs.splitlines() if f"info key {key}:" in line]
        assert len(lines) == 1, logs
        assert f"{what} cannot cross the wire (no pickle); {done}" in lines[0]
    assert "info key 'ok'" not in logs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_strings_that_are_not_unicode_come_escaped_in_infos_and_errors(start_servers: Any, transport: str) -> None:
    """A lone surrogate (a file name of bytes that are not UTF-8, decoded as Python does) in an info failed the
    whole reset or step (UnicodeEncodeError, retried for a minute by learner train), and in an env's error
    replaced it with "StepStream failed: UnicodeEncodeError"."""
    addresses = start_servers("tests.envs:NotUnicodeEnv", envs_per_server=2, transport=transport)
    zeros = np.zeros(2, dtype=np.int64)
    with RemoteVectorEnv(addresses, client_name="caf\udce9") as envs:  # (its Handshake raised UnicodeEncodeError)
        envs.reset(seed=0)
        for _ in range(2):
            *_, infos = envs.step(zeros)
            assert infos["s"].tolist() == [repr("caf\udce9")] * 2
            assert infos["k\\udce9"].tolist() == [1.0, 1.0] and infos["ok"].tolist() == ["café"] * 2
            assert infos["u"].shape == (2, 1) and all("'x\\udce9'" in item for item in infos["u"].flat), infos["u"]
        with pytest.raises(EnvCrashedError) as err:
            envs.step(zeros)
    assert "raised in step: RuntimeError: cannot open caf\\udce9.map" in str(err.value), str(err.value)
    with pytest.raises(codec.CodecError, match=r"^value: a str that is not valid Unicode \('\\udce9' at 3"):
        codec.encode_value("caf\udce9", pb.Value())


# ---------------------------------------------------------------------------------------------
# Reserved info keys


@pytest.mark.parametrize("key", ["env_error", "_env_unavailable", "env_rejoined"])
def test_an_info_with_a_reserved_key_is_an_error_of_that_env_named_so(start_servers: Any, key: str) -> None:
    # (an env's own info["env_error"] = 0.0 was taken for envfleet's record: "env 0 raised in 0.0")
    kwargs = json.dumps({"key": key, "at": 2})
    addresses = start_servers("tests.envs:ReservedKeyEnv", envs_per_server=2, server_args=["--env-kwargs", kwargs])
    zeros = np.zeros(2, dtype=np.int64)
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        envs.step(zeros)
        with pytest.raises(EnvCrashedError) as err:
            envs.step(zeros)
    assert f"ReservedInfoKeyError: the env's info has the key {key!r}, which is reserved by envfleet" in str(err.value)
    assert "rename it in the env" in str(err.value)
    # Fault-tolerant: that env's error record, at every step but the autoreset steps between (the env
    # puts the key in every step's info now), and the server serves on.
    with RemoteVectorEnv(addresses, fault_tolerant=True) as envs:
        envs.reset(seed=0)
        for t in range(4):
            *_, infos = envs.step(zeros)
            if t % 2 == 0:
                assert infos["_env_error"].all() and infos["env_unavailable"].all()
                assert f"the env's info has the key {key!r}" in infos["env_error"][0]
            else:
                assert "env_error" not in infos


def test_a_reset_info_with_a_reserved_key_is_an_error_of_that_env(start_servers: Any) -> None:
    kwargs = json.dumps({"key": "env_error", "on_reset": True, "at": 1000})
    addresses = start_servers("tests.envs:ReservedKeyEnv", envs_per_server=2, server_args=["--env-kwargs", kwargs])
    with (
        RemoteVectorEnv(addresses) as envs,
        pytest.raises(EnvCrashedError, match="env 0 returned in reset what cannot be used: ReservedInfoKeyError: "),
    ):
        envs.reset(seed=0)


# ---------------------------------------------------------------------------------------------
# Observations the policy cannot act on


def _bad_env_run(tmp_path: Path, kind: str, at: int = 2, **more: Any) -> Args:
    """A short, quiet run on BadObservationEnv(kind, at), in ``tmp_path``/run: 2 envs (seed 0: env 1 the bad
    one), 8 steps a rollout, 32 steps, on the CPU; ``more`` sets the rest or other values."""
    options: dict[str, Any] = {"seed": 0, "num_envs": 2, "num_steps": 8, "total_timesteps": 32, "device": "cpu"}
    return Args(
        env="tests.envs:BadObservationEnv",
        env_kwargs={"kind": kind, "at": at},
        run_dir=str(tmp_path / "run"),
        progress=False,
        plot=False,
        tensorboard=False,
        **{**options, **more},
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_cuda)])
@pytest.mark.parametrize("backend", ["gym", "remote"])
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nan", r"observation of env 1 has NaN or infinite values \(\[nan\]; observation space Box"),
        ("discrete", r"observation of env 1 is 7, outside the observation space Discrete\(3\)"),
        ("reward", r"reward of env 1 is nan, returned by its step at the run's env step 20: PPO cannot learn"),
    ],
)
def test_training_on_observations_the_policy_cannot_act_on_names_the_env(
    tmp_path: Path, backend: Literal["remote", "gym"], kind: str, message: str, device: str
) -> None:
    # (a raw torch traceback: "Class values must be smaller than num_classes", "probability tensor ...";
    # on CUDA a device-side assert, raised at a later call, after which the process cannot use the GPU)
    args = _bad_env_run(
        tmp_path,
        kind,
        at=10,  # (env 1's 10th step: in the 2nd rollout, after an update, whose checkpoint the error leaves)
        device=device,
        norm_obs=kind == "nan",  # (with --norm-obs, every env's normalised observation turns NaN)
        # (remote: two groups of one server each; the first group's forward fails, on env 0's NaN-normalised row)
        pipeline_groups=2 if backend == "remote" else 1,
        backend=backend,
    )
    # (remote: the server that hosts env 1 named, as the other errors name theirs; a ValueError, as it was)
    where = r"^env server \S+: " if backend == "remote" else "^"
    with pytest.raises(
        ValueError, match=where + message + (r".*; the policy cannot act on it" if kind != "reward" else "")
    ) as info:
        train(args)
    assert isinstance(info.value, UnusableEnvOutputError)
    # The run's files are written as after any error (on CUDA too: the device is still usable).
    assert rundir.list_checkpoints(tmp_path / "run") and (tmp_path / "run" / rundir.SUMMARY).is_file()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_cuda)])
@pytest.mark.parametrize("backend", ["gym", "remote"])
def test_float64_observations_beyond_float32_s_range_are_named_and_train_with_norm_obs(
    tmp_path: Path, backend: Literal["remote", "gym"], device: str
) -> None:
    """1e39 is finite as float64 and infinite as the float32 the nets take (whose tanh layers act on it
    without an error, but whose gradient turns NaN): named as the env's, at the latest at the rollout's
    end, before its update. --norm-obs scales them in float64 first: not refused there."""
    where = r"^env server \S+: " if backend == "remote" else "^"
    with pytest.raises(
        UnusableEnvOutputError,
        match=where + r"observation of env 1 has values beyond float32's range \(\[1\.e\+39\]; observation space "
        r"Box\(0\.0, inf, \(1,\), float64\)\), which the policy's float32 nets take as infinite; .*--norm-obs",
    ):
        train(_bad_env_run(tmp_path, "float64", backend=backend, device=device))
    summary = train(_bad_env_run(tmp_path / "scaled", "float64", norm_obs=True, backend=backend, device=device))
    assert summary["total_steps"] == 32 and summary["stop_reason"] == "total_timesteps"


@pytest.mark.parametrize("kind", ["float64-once", "inf-once"])
def test_an_infinite_observation_mid_rollout_is_named_not_taken_for_a_diverged_update(
    tmp_path: Path, kind: str
) -> None:
    """On the CPU the tanh layers act on inf without an error (observations are looked at only once a
    forward fails, or at the rollout's end): one met mid-rollout and gone by its end is found in the
    rollout's storage before the update, whose gradient it would turn NaN."""
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^observation of env 1 that the policy took at step 4 of the rollout ending at env step 16 was "
        r"infinite or NaN as float32: .*; the policy cannot act on it",
    ):
        train(_bad_env_run(tmp_path, kind, at=3, backend="gym"))


def test_a_run_stopped_by_an_observation_found_before_its_update_keeps_its_last_update_s_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found while the batch is made (the nets untouched since the last update): that update is checkpointed,
    not taken for a run stopped mid-update (its checkpoint was lost: up to --checkpoint-seconds of updates)."""
    args = _bad_env_run(tmp_path, "inf-once", at=19, total_timesteps=400, checkpoint_seconds=1000.0)
    with caplog.at_level(logging.WARNING, logger="learner.train"), pytest.raises(UnusableEnvOutputError):
        train(args)  # (env 1's step 19: in the 3rd rollout, after 2 updates)
    assert [p.name for p in rundir.list_checkpoints(tmp_path / "run")] == ["step-0000000016.pt", "step-0000000032.pt"]
    assert not any("during an update" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("backend", ["gym", "remote"])
def test_a_nan_observation_at_a_rollouts_end_is_named_not_taken_for_a_diverged_update(
    tmp_path: Path, backend: Literal["remote", "gym"]
) -> None:
    """The rollout's last observations only bootstrap its values (a value forward, which raises on no
    NaN): looked at first there, on the CPU too, so that a NaN one is the env's error, not the update's."""
    args = _bad_env_run(tmp_path, "nan", at=8, backend=backend)  # (env 1's 8th step: the first rollout's last)
    where = r"^env server \S+: " if backend == "remote" else "^"
    with pytest.raises(UnusableEnvOutputError, match=where + r"observation of env 1 has NaN or infinite values"):
        train(args)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_update_that_overflows_stops_the_run_saying_where_and_why(tmp_path: Path, overlap: bool) -> None:
    """Finite rewards too large for float32's squares (1e30): the value loss overflows, the gradient turns
    NaN, and so would the nets (on CUDA, the next sampling a device-side assert): the run stops with
    what happened and what to change, no checkpoint of that update written."""
    args = _bad_env_run(tmp_path, "huge", backend="gym", total_timesteps=64, overlap_update=overlap)
    with pytest.raises(
        UpdateDivergedError,
        match=r"^PPO's update diverged: the gradient's norm was (nan|inf) in epoch 1 of \d+, minibatch 1 of \d+ "
        r"\(policy loss \S+, value loss inf\), which leaves the nets NaN: the value loss overflowed: .*--norm-reward",
    ):
        train(args)
    assert not rundir.list_checkpoints(tmp_path / "run")  # (none before the first update; none of it)


@pytest.mark.parametrize("backend", ["gym", "remote"])
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nan", r"observation of env 1 has NaN or infinite values \(\[nan\]; observation space Box"),
        ("discrete", r"observation of env 1 is 7, outside the observation space Discrete\(3\)"),
        ("float64", r"observation of env 1 has values beyond float32's range \(\[1\.e\+39\]"),
    ],
)
def test_evaluating_on_observations_the_policy_cannot_act_on_names_the_env(
    tmp_path: Path, backend: str, kind: str, message: str
) -> None:
    """learner eval, as learner train: an error naming the env and its server, not a torch traceback
    (Discrete), nor returns of a policy that acted on NaN without a word (deterministic: argmax)."""
    run = tmp_path / "run"
    train(_bad_env_run(tmp_path, kind, at=10**6, backend="gym", total_timesteps=16))  # (never bad in training)
    where = r"^env server \S+: " if backend == "remote" else "^"
    with pytest.raises(UnusableEnvOutputError, match=where + message + r".*; the policy cannot act on it"):
        evaluate(run, 2, backend=backend, num_envs=2, device="cpu", env_kwargs={"kind": kind, "at": 2}, progress=False)


@pytest.mark.parametrize("backend", ["gym", "remote"])
def test_evaluating_on_a_nan_reward_names_the_env_as_training_does(tmp_path: Path, backend: str) -> None:
    """learner eval refuses a NaN or infinite reward as learner train does (its return would be no number to
    report, nor valid JSON), with the same error class, naming the env and the reward."""
    run = tmp_path / "run"
    # (never bad in training; episodes of 5 steps: without the check, eval would end, its returns NaN)
    train(_bad_env_run(tmp_path, "reward", at=10**6, backend="gym", total_timesteps=16, max_episode_steps=5))
    where = r"^env server \S+: " if backend == "remote" else "^"
    with pytest.raises(
        UnusableEnvOutputError,
        match=where + r"reward of env 1 \(.*BadObservationEnv.*\) is nan: a NaN or infinite reward makes no return",
    ) as info:
        evaluate(
            run, 2, backend=backend, num_envs=2, device="cpu", env_kwargs={"kind": "reward", "at": 2}, progress=False
        )
    assert info.value.partial_result is not None and info.value.partial_result["episodes"] == 0


@pytest.mark.parametrize(
    ("raw", "space", "usable"),
    [
        (np.array([[0.5], [1.0]], dtype=np.float32), gym.spaces.Box(-np.inf, np.inf, (1,)), True),
        (np.array([[0.5], [np.nan]], dtype=np.float32), gym.spaces.Box(-np.inf, np.inf, (1,)), False),
        (np.array([[0.0], [np.inf]]), gym.spaces.Box(-np.inf, np.inf, (1,)), False),
        (np.array([0, 7]), gym.spaces.Discrete(3), False),
        (np.array([2, 4]), gym.spaces.Discrete(3, start=2), True),
        (np.array([2, 1]), gym.spaces.Discrete(3, start=2), False),
        (np.zeros((2, 4, 4), dtype=np.uint8), gym.spaces.Box(0, 255, (4, 4), np.uint8), True),
        (np.array([[1e38], [1e39]]), gym.spaces.Box(-np.inf, np.inf, (1,), np.float64), False),
        (np.array([[1e38], [-1e38]]), gym.spaces.Box(-np.inf, np.inf, (1,), np.float64), True),
    ],
)
def test_on_cuda_observations_are_looked_at_before_the_forward_and_on_the_cpu_only_after_it_fails(
    raw: np.ndarray, space: gym.Space[Any], usable: bool
) -> None:
    """A device whose kernels fail asynchronously (CUDA; "meta" stands for it here) gets the envs'
    observations checked before each forward: its own error would be an uncatchable device-side
    assert. The CPU's forward runs first, and its error is explained after."""
    assert observations_usable(raw, space) is usable
    for device, ran_first in (("meta", usable), ("cpu", True)):
        acting = Acting(
            agent=cast(Any, None),
            actor=cast(Any, None),
            obs_space=space,
            action_space=gym.spaces.Discrete(2),
            obs_rms=None,
            obs_dtype=torch.float32,
            device=torch.device(device),
            server_of=lambda env: f"env server s{env}: ",
        )
        ran = []
        with contextlib.ExitStack() as stack:
            if not usable:
                stack.enter_context(
                    pytest.raises(UnusableEnvOutputError, match=r"^env server s1: observation of env 1 ")
                )
            with acting.acting_on(raw, [0, 1]):
                ran.append(True)
                if not usable:
                    raise RuntimeError("the forward's own error")
        assert bool(ran) is ran_first, device


def test_the_rollout_s_check_takes_observations_of_any_shape() -> None:
    acting = Acting(
        agent=cast(Any, None),
        actor=cast(Any, None),
        obs_space=gym.spaces.Box(-np.inf, np.inf, ()),
        action_space=gym.spaces.Discrete(2),
        obs_rms=None,
        obs_dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for shape in ((), (3,), (2, 2)):
        obs = torch.zeros((4, 2, *shape))
        acting.check_taken(obs, 8)
        obs[2, 1] = float("inf")
        with pytest.raises(UnusableEnvOutputError, match=r"^observation of env 1 that the policy took at step 3 "):
            acting.check_taken(obs, 8)
    acting.check_taken(torch.zeros((4, 2), dtype=torch.uint8), 8)  # (frames: nothing to look at)
