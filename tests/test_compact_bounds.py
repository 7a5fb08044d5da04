"""Compact Box bounds (GetSpecRequest/HandshakeRequest.accepts_compact_bounds): what old and new learners get
from a server, new learners on servers older than the field and in fleets mixing both, and an observation
whose spec could not be sent with full-shape bounds."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
import pytest

from env_server import codec
from env_server.config import ServerConfig
from env_server.envs import build_vector_env
from env_server.protocol import MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.service import SPEC_ROOM, EnvService, _full_spec_most
from learner import RemoteVectorEnv
from learner.cli import main
from learner.specs import incompatible
from tests.conftest import SpawnServer
from tests.envs import BoundsEnv
from tests.faulty_server import FaultyServer

OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


@pytest.fixture
def full_bounds_server() -> Iterator[str]:
    """The address of a server of BoundsEnv (2 envs) as servers older than compact bounds served."""
    argv = ["--env", "tests.envs:BoundsEnv", "--num-envs", "2", "--host", "127.0.0.1", "--port", "0"]
    with subprocess.Popen(
        [sys.executable, "-m", "tests.full_bounds_server", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line.startswith("listening on "), line
            yield line.removeprefix("listening on ")
        finally:
            proc.kill()


def _spaces(spec: pb.EnvSpec) -> tuple[pb.Space, pb.Space]:
    return spec.observation_space, spec.action_space


def test_an_old_learner_gets_full_bounds_and_a_new_one_compact_ones_where_uniform(spawn_server: SpawnServer) -> None:
    env = BoundsEnv()
    full = codec.encode_space(env.observation_space), codec.encode_space(env.action_space)
    compact = (
        codec.encode_space(env.observation_space, compact=True),
        codec.encode_space(env.action_space, compact=True),
    )
    server = spawn_server("tests.envs:BoundsEnv", 2)
    with grpc.insecure_channel(server.address, options=OPTIONS) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        # (a) A request without the field (an old learner's): today's bytes, every bound at full shape.
        assert _spaces(stub.GetSpec(pb.GetSpecRequest(), timeout=30).spec) == full
        hello = stub.Handshake(pb.HandshakeRequest(client_name="old"), timeout=30)
        assert _spaces(hello.spec) == full
        stub.Release(pb.ReleaseRequest(session_id=hello.session_id), timeout=30)
        # (b) A new learner's: uniform bounds as one value, the others at full shape.
        spec = stub.GetSpec(pb.GetSpecRequest(accepts_compact_bounds=True), timeout=30).spec
        assert _spaces(spec) == compact
        hello = stub.Handshake(pb.HandshakeRequest(client_name="new", accepts_compact_bounds=True), timeout=30)
        assert _spaces(hello.spec) == compact
        stub.Release(pb.ReleaseRequest(session_id=hello.session_id), timeout=30)
    boxes = dict(zip(spec.observation_space.dict.keys, spec.observation_space.dict.spaces, strict=True))
    camera, vector, counts = boxes["camera"].box, boxes["vector"].box, boxes["counts"].box
    assert list(camera.shape) == [16, 16, 3] and not camera.low.shape and not camera.high.shape
    assert not vector.shape and list(vector.low.shape) == list(vector.high.shape) == [3]
    # (one element unbounded below: low and its mask at full shape; no upper bound anywhere: one value each)
    assert list(counts.low.shape) == list(counts.unbounded_below.shape) == [3]
    assert not counts.high.shape and not counts.unbounded_above.shape and list(counts.shape) == [3]
    assert boxes["camera"].ByteSize() < 40 < full[0].dict.spaces[0].ByteSize()


@pytest.mark.parametrize("env_id", ["tests.envs:BoundsEnv", "CartPole-v1"])
def test_the_full_bounds_spec_is_built_at_the_first_old_request_as_it_was_at_start(env_id: str) -> None:
    """Where it surely fits an answer, the spec with full-shape bounds (twice a camera frame) is built at the first
    request without accepts_compact_bounds, not at start: the same bytes a spec made at start has (every field,
    the versions included), kept for the next requests; one copy where no bound is compact (CartPole's)."""
    service = EnvService(ServerConfig(env=env_id, num_envs=2))
    envs = build_vector_env(service._config)
    try:
        service.attach(envs)
        assert service._full_spec is None and service._full_spec_later is not None
        assert 0 < service.full_spec_bytes <= SPEC_ROOM  # (the least it takes, until built)
        made_at_start = service._make_spec()  # (how attach made it before)
        full = service._spec_for(False, "GetSpecRequest")
        assert full.SerializeToString(deterministic=True) == made_at_start.SerializeToString(deterministic=True)
        assert service.full_spec_bytes == full.ByteSize() and service._full_spec_later is None
        assert service._spec_for(False, "HandshakeRequest") is full
        assert service._spec_for(True, "GetSpecRequest") is service.spec
        assert (full is service.spec) == (env_id == "CartPole-v1")
        # (built at once, as before, where it may not fit: the same spec)
        assert service._make_full_spec(envs.single_observation_space, envs.single_action_space) == full
    finally:
        service.close()
        envs.close()


def _most_cases() -> list[tuple[gym.Space[Any], gym.Space[Any]]]:
    """Observation and action spaces whose spec grows most with its bounds at full shape, for its size compact:
    many small Boxes (each bound's tensor gets a shape and a data length), many dimensions, integer Boxes
    unbounded everywhere (their masks at full shape too), nested Dicts and Tuples."""
    env = BoundsEnv()
    small = gym.spaces.Dict({f"k{i}": gym.spaces.Box(-1.0, 1.0, (2,), np.float64) for i in range(200)})
    dims = gym.spaces.Box(0, 255, (2, 1, 3, 1, 2, 1, 1, 2), np.uint8)
    wide_dims = gym.spaces.Box(-1.0, 1.0, (70000, 3), np.float32)
    unbounded = gym.spaces.Box(-np.inf, np.inf, (5, 7), np.int64)
    nested = gym.spaces.Tuple(
        (gym.spaces.Dict({"a": gym.spaces.Tuple((unbounded, gym.spaces.Box(0, 1, (3,), np.int8)))}), dims)
    )
    discrete = gym.spaces.Discrete(3)
    return [
        (env.observation_space, env.action_space),
        (small, small),
        (dims, discrete),
        (wide_dims, unbounded),
        (nested, nested),
        (gym.spaces.Box(0.0, 1.0, (1,)), gym.spaces.Box(0.0, 1.0, (0, 4))),
    ]


@pytest.mark.parametrize("case", range(len(_most_cases())))
def test_the_full_bounds_spec_takes_no_more_than_the_most_attach_reckons(case: int) -> None:
    """attach builds the full-shape spec at the first old request only where service._full_spec_most says it
    fits; what it reckons is never less than the spec then takes."""
    obs_space, act_space = _most_cases()[case]
    compact = pb.EnvSpec(env_id="tests.envs:BoundsEnv", num_envs=2)
    codec.encode_space(obs_space, compact.observation_space, compact=True)
    codec.encode_space(act_space, compact.action_space, compact=True)
    full = pb.EnvSpec(env_id="tests.envs:BoundsEnv", num_envs=2)
    codec.encode_space(obs_space, full.observation_space)
    codec.encode_space(act_space, full.action_space)
    assert full.ByteSize() <= _full_spec_most(obs_space, act_space, compact), (full.ByteSize(), compact.ByteSize())


def test_an_old_learner_gets_the_same_full_bounds_spec_before_and_after_a_fresh_envs_rebuild(
    spawn_server: SpawnServer,
) -> None:
    """--fresh-envs: a new learner's Handshake builds the envs anew and attaches them again, which leaves the
    full-shape spec to be made again at the first old request after it: the same spec as before the rebuild
    (the old Handshake's own refusal check made it of the old envs first, then of the new)."""
    server = spawn_server("tests.envs:BoundsEnv", 2, "--fresh-envs")
    with grpc.insecure_channel(server.address, options=OPTIONS) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        before = stub.GetSpec(pb.GetSpecRequest(), timeout=30).spec
        compact = stub.GetSpec(pb.GetSpecRequest(accepts_compact_bounds=True), timeout=30).spec
        assert before != compact and before.ByteSize() > compact.ByteSize()
        with RemoteVectorEnv([server.address]) as envs:  # (a session whose envs run: the next one's are rebuilt)
            envs.reset(seed=0)
        hello = stub.Handshake(pb.HandshakeRequest(client_name="old"), timeout=60)
        assert "rebuilt in" in server.logs(), server.logs()
        assert hello.spec.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True)
        stub.Release(pb.ReleaseRequest(session_id=hello.session_id), timeout=30)
        assert stub.GetSpec(pb.GetSpecRequest(), timeout=30).spec == before
        assert stub.GetSpec(pb.GetSpecRequest(accepts_compact_bounds=True), timeout=30).spec == compact


def test_a_new_learner_reads_an_old_servers_full_bounds_and_a_fleet_mixing_both(
    spawn_server: SpawnServer, full_bounds_server: str
) -> None:
    """The spaces are the env's whichever form crossed, and the fleet's servers agree on them (their specs
    compared as one form: refused as 'another observation_space' otherwise)."""
    env = BoundsEnv()
    new = spawn_server("tests.envs:BoundsEnv", 2).address
    for addresses in ([full_bounds_server], [new, full_bounds_server], [full_bounds_server, new]):
        with RemoteVectorEnv(addresses, connect_timeout=30) as envs:
            assert envs.single_observation_space == env.observation_space
            assert envs.single_action_space == env.action_space
            counts = envs.single_observation_space["counts"]  # type: ignore[index]
            assert counts.bounded_below.tolist() == [False, True, True] and not counts.bounded_above.any()
            obs, _ = envs.reset(seed=0)
            assert obs["camera"].shape == (envs.num_envs, 16, 16, 3)
            envs.step(np.zeros((envs.num_envs, 3), np.float32))


def test_a_fleet_compares_spaces_in_one_form_and_says_what_differs_in_it() -> None:
    def spec(space: gym.Space[Any], compact: bool) -> pb.EnvSpec:
        return pb.EnvSpec(
            env_id="Cam-v0",
            observation_space=codec.encode_space(space, compact=compact),
            action_space=codec.encode_space(gym.spaces.Discrete(2)),
        )

    camera = gym.spaces.Box(0, 255, (4, 4, 3), np.uint8)
    assert incompatible(spec(camera, False), spec(camera, True)) == ""
    assert incompatible(spec(camera, True), spec(camera, False)) == ""
    # (integer Boxes print the same whether or not an element is unbounded: the difference is said, as compact)
    free, limits = (
        gym.spaces.Box(-np.inf, 5, (30,), np.int32),
        gym.spaces.Box(np.iinfo(np.int32).min, 5, (30,), np.int32),
    )
    said = incompatible(spec(limits, True), spec(free, False))
    assert "differ in observation_space.box.unbounded_below (its: true (bool); the fleet's: not set)" in said, said


def test_every_spec_request_of_the_learner_asks_for_compact_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """RemoteVectorEnv's Handshake and the GetSpecs that probe its address, `learner servers`' GetSpecs (learner
    check, the SB3 adapter, discovery and reconnects go through the same client)."""
    with FaultyServer() as server:
        with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
            envs.reset(seed=0)
        asked = list(server.service.compact_asked)
        assert ("Handshake", True) in asked and ("GetSpec", True) in asked, asked
        assert main(["servers", "--servers", server.address]) == 0
        asked = server.service.compact_asked[len(asked) :]
        assert asked and all(method == "GetSpec" for method, _ in asked), asked
        assert all(flag for _, flag in server.service.compact_asked), server.service.compact_asked
    assert "CartPole-v1 x2" in capsys.readouterr().out


@pytest.mark.slow
def test_an_observation_over_32_mib_is_served_to_new_learners_and_old_ones_are_told_why_not(
    spawn_server: SpawnServer,
) -> None:
    """33 MiB (34.6 MB) observations: one fits a step's answer; with full-shape bounds (69 MB) its spec would not,
    so the server used to refuse to start. New learners connect, reset and step; old ones are refused, saying so.
    (33 MiB, not more: the server peaks at ~0.4 GB as it starts, the learner at ~0.5 GB, most of it gymnasium's
    Box arrays, four of the observation's size a Box, twice: the env's and the batch's.)"""
    server = spawn_server("tests.hang_envs:HugeObservations", 1, "--env-kwargs", '{"mib": 33}')
    assert "learners older than compact bounds (before 2026-12-07) are refused" in server.logs(), server.logs()
    with grpc.insecure_channel(server.address, options=OPTIONS) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        for call in (
            lambda: stub.GetSpec(pb.GetSpecRequest(), timeout=30),
            lambda: stub.Handshake(pb.HandshakeRequest(client_name="old"), timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "this server's spec takes 69,206," in str(info.value.details())
            assert "did not set accepts_compact_bounds, which gets it in" in str(info.value.details())
    # (the refused Handshake claimed nothing: a new learner's is granted)
    with RemoteVectorEnv([server.address], timeout=120, connect_timeout=60) as envs:
        assert envs.single_observation_space.shape == (33, 1024, 1024)
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (1, 33, 1024, 1024)
        obs, *_ = envs.step(np.zeros(1, np.int64))
        assert obs.shape == (1, 33, 1024, 1024) and not obs.any()
