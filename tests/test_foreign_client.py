"""The server as a client written from the proto alone meets it: raw gRPC stubs, as another language's
client would call, with other limits and deadlines than envfleet's learner."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from env_server.protocol import MAX_MESSAGE_BYTES, NOT_OWNED
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import RemoteVectorEnv
from tests.conftest import ServerProcess, SpawnServer
from tests.test_metrics import scrape

TOKEN = "s3cret-token_for.tests"
# A spec of 32 MB (WideActionEnv's Box bounds: 2 x 2M float64), as a Box observation of 16 MB makes:
# over gRPC's default receive limit (4 MiB), and far more than crosses loopback in a millisecond.
WIDE = (
    "tests.envs:WideActionEnv",
    1,
    "--env-kwargs",
    '{"width": 2000000}',
    "--claim-timeout",
    "600",
    "--metrics-port",
    "0",
)


@pytest.fixture
def wide_spec(spawn_server: SpawnServer) -> ServerProcess:
    """A server whose Handshake answers take 32 MB, and whose claims last 10 minutes unless ended."""
    return spawn_server(*WIDE)


@pytest.fixture
def channel(wide_spec: ServerProcess) -> Iterator[grpc.Channel]:
    """A channel to ``wide_spec`` that takes answers as large as the server sends."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(wide_spec.address, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)  # (so that short deadlines are the server's to meet)
        yield channel


def handshake_soon(channel: grpc.Channel, within: float = 10.0) -> pb.HandshakeResponse:
    """A Handshake granted within ``within`` seconds (the server noticed that the last answer was
    lost; its claim timeout is 600 s), then released."""
    stub = pb_grpc.EnvServiceStub(channel)
    start = time.monotonic()
    while True:
        try:
            response = stub.Handshake(pb.HandshakeRequest(client_name="retry"), timeout=60)
            break
        except grpc.RpcError as err:
            # (refused while the lost answer is still being sent, as the refusal says)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "is still being sent" in str(err.details()), err.details()
            assert time.monotonic() - start < within, err.details()
            time.sleep(0.05)
    stub.Release(pb.ReleaseRequest(session_id=response.session_id), timeout=60)
    return response


def test_a_handshake_whose_deadline_passes_before_its_answer_is_sent_claims_nothing(
    wide_spec: ServerProcess, channel: grpc.Channel
) -> None:
    stub = pb_grpc.EnvServiceStub(channel)
    for deadline in (0.0005, 0.001, 0.003):
        with pytest.raises(grpc.RpcError) as info:
            stub.Handshake(pb.HandshakeRequest(client_name="hasty"), timeout=deadline)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The retry is granted, not refused "claimed by 'hasty'" for the claim timeout.
        handshake_soon(channel)
    logs = wide_spec.logs()
    assert "Traceback" not in logs and "ExecuteBatchError" not in logs, logs
    # (those that reached the server: refused unclaimed, or claimed and given up, each said so)
    lost = re.findall(r"ended: its Handshake answer \([\d,]+ bytes\) did not reach the client: ([^;]*);", logs)
    assert lost or "deadline passed before the server could answer it; nothing was claimed" in logs, logs


def test_a_handshake_answer_over_the_clients_receive_limit_claims_nothing(
    wide_spec: ServerProcess, channel: grpc.Channel
) -> None:
    # gRPC's default receive limit (4 MiB), as a client that sets none has it.
    with grpc.insecure_channel(wide_spec.address) as small:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.EnvServiceStub(small).Handshake(pb.HandshakeRequest(client_name="small"), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Received message larger than max" in str(info.value.details())
    answer = handshake_soon(channel)
    assert answer.ByteSize() > 32_000_000
    logs = wide_spec.logs()
    assert "Traceback" not in logs and "ExecuteBatchError" not in logs, logs
    assert re.search(
        r"session \w{8} of .+ ended: its Handshake answer \([\d,]{10} bytes\) did not reach the client: the call "
        r"ended while it was being sent \(the client cancelled it, its connection closed, or it refused an answer "
        r"that large: is its max receive message length at least that\? gRPC's default is 4 MiB\); the envs are "
        "free again",
        logs,
    ), logs
    metrics = re.search(r"Prometheus metrics on (http://\S+/metrics)", logs)
    assert metrics is not None, logs
    samples = scrape(metrics.group(1))
    assert samples["envfleet_sessions_ended_total{reason=unanswered}"] == 1.0, samples
    assert samples["envfleet_sessions_started_total"] == 2.0, samples


def test_the_learner_still_handshakes_and_holds_a_server_of_large_answers(wide_spec: ServerProcess) -> None:
    with RemoteVectorEnv([wide_spec.address], timeout=60) as envs:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (1, 2)
    assert "did not reach the client" not in wide_spec.logs()


def test_a_claim_no_call_has_used_says_so_to_the_next_handshake(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 2)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        first = stub.Handshake(pb.HandshakeRequest(client_name="foreign"), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            stub.Handshake(pb.HandshakeRequest(client_name="foreign"), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = str(info.value.details())
        assert "this server's envs are claimed by 'foreign'" in details
        assert (
            "No call has used that session yet: if that learner is you, your client did not get the Handshake's "
            f"answer, which takes {first.ByteSize():,} bytes (did its deadline pass, or did it give the call up?); "
            "the claim ends in "
        ) in details, details
        # Once a call used it, its client had the answer: no such guess.
        stub.Reset(pb.ResetRequest(session_id=first.session_id), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            stub.Handshake(pb.HandshakeRequest(client_name="other"), timeout=10)
        assert "No call has used" not in str(info.value.details())
        stub.Release(pb.ReleaseRequest(session_id=first.session_id), timeout=10)
    # (the hint about the receive limit is for answers over gRPC's default 4 MiB, as in the tests above)


def test_the_call_sequence_the_proto_gives_ends_hold_with_released(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 2)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        assert stub.GetSpec(pb.GetSpecRequest(), timeout=10).claimed_by == ""
        session = stub.Handshake(pb.HandshakeRequest(client_name="foreign"), timeout=10).session_id
        hold = stub.Hold(pb.HoldRequest(session_id=session))
        stub.Reset(pb.ResetRequest(session_id=session), timeout=10)
        step = pb.StepRequest(session_id=session)
        step.actions.tensor.dtype = pb.DTYPE_INT64
        step.actions.tensor.shape[:] = [2]
        step.actions.tensor.data = np.ones(2, "<i8").tobytes()
        assert len(list(stub.StepStream(iter([step] * 3), timeout=10))) == 3
        stub.Release(pb.ReleaseRequest(session_id=session), timeout=10)
        assert [event.reason for event in hold] == ["released"]  # (then the stream ends, status OK)
        assert hold.code() == grpc.StatusCode.OK


def test_an_empty_session_id_is_named_as_such(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 2)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        calls = {
            "Reset": lambda: stub.Reset(pb.ResetRequest(), timeout=10),
            "Step": lambda: stub.Step(pb.StepRequest(), timeout=10),
            "Hold": lambda: list(stub.Hold(pb.HoldRequest(), timeout=10)),
        }
        session = ""
        for _ in range(2):  # (unclaimed, then claimed)
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
                # (with the text a client compares to know it must call Handshake, see the proto)
                assert info.value.details() == (
                    f"session_id: expected the session id a Handshake returned, got an empty one, which {NOT_OWNED}; "
                    "call Handshake first and send its answer's session_id in every later request"
                ), name
            session = session or stub.Handshake(pb.HandshakeRequest(), timeout=10).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=10)  # (it was not disturbed)


def test_the_disabled_autoreset_refusal_names_the_wire_field_that_resets(spawn_server: SpawnServer) -> None:
    server = spawn_server("tests.envs:ClockEnv", 2, "--env-kwargs", '{"length": 1}', "--autoreset-mode", "Disabled")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(), timeout=10).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=10)
        step = pb.StepRequest(session_id=session)
        step.actions.tensor.dtype = pb.DTYPE_INT64
        step.actions.tensor.shape[:] = [2]
        step.actions.tensor.data = np.zeros(2, "<i8").tobytes()
        stub.Step(step, timeout=10)  # (episodes of one step: both envs end)
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(step, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            "reset them first (a Reset whose ResetRequest.reset_mask selects those envs, which the Python learner "
            "sends for reset(options={'reset_mask': mask}), or a full reset); nothing was stepped"
        ) in str(info.value.details())
        # The advice, followed on the wire, works; the Python API's form of it is refused there.
        options = pb.ResetRequest(session_id=session)
        options.options.map.keys.append("reset_mask")
        options.options.map.values.add().tensor.CopyFrom(step.actions.tensor)
        with pytest.raises(grpc.RpcError, match="reserved"):
            stub.Reset(options, timeout=10)
        stub.Reset(pb.ResetRequest(session_id=session, reset_mask=[True, True]), timeout=10)
        stub.Step(step, timeout=10)


def _zeros_step(session: str, num_envs: int) -> pb.StepRequest:
    """A Step of action 0 for each of ``num_envs`` envs, built from the proto alone."""
    step = pb.StepRequest(session_id=session)
    step.actions.tensor.dtype = pb.DTYPE_INT64
    step.actions.tensor.shape[:] = [num_envs]
    step.actions.tensor.data = np.zeros(num_envs, "<i8").tobytes()
    return step


def test_envs_a_masked_reset_left_out_under_disabled_autoreset_still_wait_for_theirs(spawn_server: SpawnServer) -> None:
    """The step after a masked reset is refused, naming the ended env the mask left out, before it
    reaches gymnasium's assertion (was: every ended env forgotten, since gymnasium's vector envs pop
    reset_mask from the options they are given; the step failed INTERNAL and cost a full reset)."""
    server = spawn_server("tests.envs:ClockEnv", 3, "--env-kwargs", '{"length": 1}', "--autoreset-mode", "Disabled")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(), timeout=10).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=10)
        step = _zeros_step(session, 3)
        stub.Step(step, timeout=10)  # (episodes of one step: the 3 envs end)
        stub.Reset(pb.ResetRequest(session_id=session, reset_mask=[True, False, True]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(step, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "and env 1 of it ended at the last step: reset it first" in str(info.value.details())
        stub.Reset(pb.ResetRequest(session_id=session, reset_mask=[False, True, False]), timeout=10)
        stub.Step(step, timeout=10)  # (nothing was lost: a masked reset of the last one is enough)


@pytest.mark.slow
@pytest.mark.parametrize("at", [1, 5], ids=["on-the-env-thread", "on-the-loop"])
@pytest.mark.parametrize("mode", ["NextStep", "Disabled"])
def test_a_step_whose_caller_gave_up_has_the_next_one_refused_until_a_full_reset(
    spawn_server: SpawnServer, tmp_path: Path, mode: str, at: int
) -> None:
    """The env's step goes on after its call's deadline passed, and what it ended there (an episode,
    reset unseen under next-step autoreset; envs that wait for their reset under Disabled) the client
    never saw: its next step is refused until a full reset (was: stepped on, from where the client did
    not know; under Disabled into gymnasium's assertion, INTERNAL). The first step runs on the env
    thread (cancelled there); later ones, quick so far, on the server's loop, where nothing cancels them:
    their answer is found to be late once they return."""
    gate = tmp_path / "gate"
    kwargs = json.dumps({"gate": str(gate), "at": at, "length": at})  # (the step that ends the episode)
    server = spawn_server("tests.envs:GateEnv", 1, "--env-kwargs", kwargs, "--autoreset-mode", mode)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(), timeout=10).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=10)
        step = _zeros_step(session, 1)
        for _ in range(at - 1):
            stub.Step(step, timeout=10)
        given_up = stub.Step.future(step, timeout=2.0)
        deadline = time.monotonic() + 30
        while not gate.exists():  # (the step is in the env, held there)
            assert time.monotonic() < deadline and not given_up.done(), "the step did not reach the env"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as lost:
            given_up.result()
        assert lost.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.5)  # (the server's deadline, which passes a moment after the client's, ends its call)
        refused = stub.Step.future(step, timeout=30)  # (sent while the lost step still runs)
        gate.unlink()
        with pytest.raises(grpc.RpcError) as info:
            refused.result()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert info.value.details() == (
            "the envs stepped for an earlier Step whose caller gave up on it (its deadline passed, or it was "
            "cancelled) before its answer came, so they are not where this session last saw them: reset them "
            "first (a full reset); nothing was stepped"
        )
        with pytest.raises(grpc.RpcError, match="reset every env once before resetting some"):
            stub.Reset(pb.ResetRequest(session_id=session, reset_mask=[True]), timeout=10)
        stub.Reset(pb.ResetRequest(session_id=session), timeout=10)
        stub.Step(step, timeout=10)


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), "no token was sent (no 'authorization' metadata)"),
        ((("authorization", ""),), "the 'authorization' metadata is empty (expected 'Bearer <token>')"),
        ((("authorization", TOKEN),), "the 'authorization' metadata does not start with 'Bearer '"),
        ((("authorization", f"bearer {TOKEN}"),), "starts with another case of 'Bearer ' (expected exactly 'Bearer ')"),
        ((("authorization", "Bearer "),), "the 'authorization' metadata has no token after 'Bearer '"),
        ((("authorization", f"Bearer  {TOKEN}"),), "the token after 'Bearer ' has spaces or characters outside"),
        ((("authorization", f"Bearer {TOKEN}x"),), "the token is wrong"),
        ((("authorization", "Bearer x"),), "the token is wrong"),
    ],
)
def test_a_refused_token_says_whether_its_form_or_the_token_is_wrong(
    tokened: ServerProcess, metadata: tuple[tuple[str, str], ...], reason: str
) -> None:
    with grpc.insecure_channel(tokened.address) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.EnvServiceStub(channel).GetSpec(pb.GetSpecRequest(), timeout=10, metadata=metadata)
    details = str(info.value.details())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert details.startswith("/envfleet.v1.EnvService/GetSpec: this server requires an auth token and ")
    assert reason in details, details
    assert details.endswith(
        "; send the server's token as metadata 'authorization: Bearer <token>' with every call (envfleet's "
        "Python learner: RemoteVectorEnv(auth_token=...); learner train --auth-token-file or --auth-token, or "
        "ENVFLEET_AUTH_TOKEN_FILE or ENVFLEET_AUTH_TOKEN in its environment)"
    ), details
    assert TOKEN not in details and TOKEN[:6] not in details


@pytest.fixture(scope="module")
def tokened() -> Iterator[ServerProcess]:
    """A CartPole server that requires TOKEN, for the module."""
    server = ServerProcess("CartPole-v1", 1, environ={"ENVFLEET_AUTH_TOKEN": TOKEN})
    yield server
    assert TOKEN not in server.logs()
    server.stop()


@pytest.mark.slow
def test_a_spec_too_large_for_its_answers_is_refused_at_start() -> None:
    # A 33 MiB observation fits an answer (64 MiB less 1 MiB); its spec, whose Box bounds take twice that, does not
    # where one of them is not the same in every element (sent at full shape even to learners that read compact
    # bounds; uniform ones are served: tests/test_compact_bounds.py).
    argv = ["--env", "tests.hang_envs:HugeObservations", "--env-kwargs", '{"mib": 33, "uniform": false}', "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "env_server", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done
    assert re.search(
        r"cannot serve 'tests.hang_envs:HugeObservations': its spec \(the answer to GetSpec and Handshake\) takes "
        r"69,206,\d{3} bytes, over the 67,104,768 bytes a message leaves it \(64 MiB less 4 KiB for the rest of the "
        r"answer\): a Box space whose low or high bounds differ between elements sends them at full shape \(bounds "
        r"of one value go as that value\); the observation space's take 69,206,\d{3} bytes, the action space's \d+; it "
        r"cannot be sent: serve an env with smaller spaces",
        done.stderr,
    ), done.stderr
