"""A deliberately misbehaving envfleet.v1 server: a grpc.aio EnvService on 127.0.0.1:0, in a thread of
the test process, serving CartPole with the faults a test asks for (those of servers written from the
proto alone, in other languages).

It answers as the proto says unless told otherwise: GetSpec and Handshake with a CartPole spec
(env_server.codec's encoding), Hold kept open until Release, Reset and StepStream with a real
gymnasium vector env's results, Release. What it gets wrong is in :class:`Faults`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import gymnasium as gym
import numpy as np

from env_server import codec
from env_server.protocol import ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER, NOT_OWNED, PROTOCOL_VERSION
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc

__all__ = ["FaultyServer", "Faults"]

Status = tuple[grpc.StatusCode, str]


@dataclass
class Faults:
    """What the server does wrong (the defaults: nothing)."""

    session_id: str | None = None
    """Every Handshake answer's session_id (None: a fresh one each time, as a server should)."""
    server_id: str | None = None
    """The spec's server_id (None: one random id for the server's life, as a server should)."""
    claim_timeout_s: float = 30.0
    """HandshakeResponse.claim_timeout_s."""
    hold: str = "hold"
    """"hold": open until Release, then a HoldEvent "released" and OK; "ok": ends at once, status OK, no
    HoldEvent; "unimplemented": gRPC's own answer for a method a server lacks; "error": ends at once
    with :attr:`hold_status`."""
    hold_status: Status = (grpc.StatusCode.UNKNOWN, "")
    """The status of ``hold="error"``."""
    steps_per_stream: int | None = None
    """Answer this many StepRequests on a stream, then end it at once with :attr:`stream_status`
    (None: answer every one)."""
    stream_status: Status = (grpc.StatusCode.OK, "")
    """The status a stream ends with after :attr:`steps_per_stream` answers."""
    env_id: str = "CartPole-v1"
    """The spec's env_id."""
    claimed_by: str = ""
    """GetSpecResponse.claimed_by."""
    claimed: bool = False
    """Refuse every Handshake as a server another learner holds does (RESOURCE_EXHAUSTED); set it back to
    False for that learner's release."""
    twice_every: int | None = None
    """Send every ``twice_every``-th answer of each stream twice (None: never)."""
    twice_at: int | None = None
    """Send the answer to the server's step number ``twice_at`` (from 1, over all streams) twice, once
    (None: never)."""
    echo_step_id: bool = True
    """Return StepRequest.step_id in the answer (servers older than the field do not)."""
    marked: bool = False
    """Whether error statuses carry envfleet's origin mark (an envfleet server's do; a foreign one's may not)."""
    trailers: list[tuple[str, str]] = field(default_factory=list)
    """More trailing metadata for every error status."""
    handshake_hook: Callable[[], None] | None = None
    """Called (on the server's thread) by each Handshake once it has granted its session, before it answers:
    a test's Ctrl-C to the learner, landing while the Handshake is in flight."""
    handshake_delay_s: float = 0.0
    """How long each Handshake waits, its session granted (and :attr:`handshake_hook` called), before it answers."""
    reset_hook: Callable[[], None] | None = None
    """Called (on the server's thread) by each Reset before it answers: a test's Ctrl-C to the learner, landing while
    the Reset is in flight."""
    reset_delay_s: float = 0.0
    """How long each Reset waits (after :attr:`reset_hook`) before it answers."""
    exclusive: bool = False
    """Refuse a Handshake while a session it granted is neither released nor dropped (RESOURCE_EXHAUSTED, as an
    envfleet server that holds a claim does; no claim timeout here: a session left unreleased holds it for good)."""


class _Service(pb_grpc.EnvServiceServicer):
    def __init__(self, faults: Faults, num_envs: int) -> None:
        self.faults = faults
        self.steps = 0  # (answered on all streams)
        self.env = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
        self.spec = pb.EnvSpec(
            protocol_version=PROTOCOL_VERSION,
            env_id=faults.env_id,
            num_envs=num_envs,
            autoreset_mode=pb.AUTORESET_MODE_NEXT_STEP,
            server_id=uuid.uuid4().hex if faults.server_id is None else faults.server_id,
            vectorization="sync",
            max_episode_steps=500,
        )
        codec.encode_space(self.env.single_observation_space, self.spec.observation_space, "observation_space")
        codec.encode_space(self.env.single_action_space, self.spec.action_space, "action_space")
        self.handshakes = 0
        self.spec_calls = 0  # (GetSpec calls answered)
        # (each GetSpec's and Handshake's method and accepts_compact_bounds: the spec is sent at full shape, as
        # a server older than the field sends it, whatever the request says)
        self.compact_asked: list[tuple[str, bool]] = []
        self.holds = 0
        self._live: set[str] = set()  # (sessions, as a server without Hold keeps them: until dropped)
        self.granted: list[str] = []  # (the session ids Handshakes granted, and those Releases named, in order)
        self.released: list[str] = []
        self._released: dict[str, asyncio.Event] = {}

    def drop_sessions(self) -> None:
        """Let go of every session (as one whose claim timed out)."""
        self._live = set()

    async def _check_session(self, session_id: str, context: grpc.aio.ServicerContext) -> None:
        if session_id not in self._live:
            self.faults.marked, marked = True, self.faults.marked
            try:
                await self._fail(context, (grpc.StatusCode.FAILED_PRECONDITION, f"this session {NOT_OWNED}"))
            finally:
                self.faults.marked = marked

    async def _fail(self, context: grpc.aio.ServicerContext, status: Status) -> None:
        code, details = status
        trailers = list(self.faults.trailers)
        if self.faults.marked:
            trailers.append((ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER))
        await context.abort(code, details, tuple(trailers))

    async def GetSpec(self, request: pb.GetSpecRequest, context: grpc.aio.ServicerContext) -> pb.GetSpecResponse:
        self.spec_calls += 1
        self.compact_asked.append(("GetSpec", request.accepts_compact_bounds))
        return pb.GetSpecResponse(spec=self.spec, claimed_by=self.faults.claimed_by)

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        self.handshakes += 1
        self.compact_asked.append(("Handshake", request.accepts_compact_bounds))
        if self.faults.claimed:
            await self._fail(context, (grpc.StatusCode.RESOURCE_EXHAUSTED, "this server's envs are claimed by 'other'"))
        if self.faults.exclusive and self._live:
            await self._fail(
                context, (grpc.StatusCode.RESOURCE_EXHAUSTED, "this server's envs are claimed by a session")
            )
        session_id = uuid.uuid4().hex if self.faults.session_id is None else self.faults.session_id
        self._released[session_id] = asyncio.Event()
        self._live.add(session_id)
        self.granted.append(session_id)
        if self.faults.handshake_hook is not None:
            self.faults.handshake_hook()
        if self.faults.handshake_delay_s:
            await asyncio.sleep(self.faults.handshake_delay_s)
        return pb.HandshakeResponse(
            session_id=session_id, spec=self.spec, claim_timeout_s=self.faults.claim_timeout_s, checks_token=False
        )

    async def Hold(self, request: pb.HoldRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.HoldEvent]:
        self.holds += 1
        hold = self.faults.hold
        if hold == "unimplemented":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if hold == "error":
            await self._fail(context, self.faults.hold_status)
        if hold == "hold":
            await self._released.setdefault(request.session_id, asyncio.Event()).wait()
            yield pb.HoldEvent(reason="released")

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetResponse:
        await self._check_session(request.session_id, context)
        if self.faults.reset_hook is not None:
            self.faults.reset_hook()
        if self.faults.reset_delay_s:
            await asyncio.sleep(self.faults.reset_delay_s)
        seeds = [s.value if s.HasField("value") else None for s in request.seeds] or None
        options = {"reset_mask": np.array(request.reset_mask)} if request.reset_mask else None
        obs, _ = self.env.reset(seed=seeds, options=options)
        response = pb.ResetResponse()
        codec.encode_value(obs, response.observations, "observations")
        codec.encode_value({}, response.infos, "infos")
        return response

    async def StepStream(
        self, requests: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResponse]:
        answered = 0
        async for request in requests:
            await self._check_session(request.session_id, context)
            if self.faults.steps_per_stream is not None and answered >= self.faults.steps_per_stream:
                break
            response = self._step(request)
            yield response
            answered += 1
            self.steps += 1
            if self.steps == self.faults.twice_at or (
                self.faults.twice_every is not None and answered % self.faults.twice_every == 0
            ):
                yield response
            if answered == self.faults.steps_per_stream:
                break
        code, _ = self.faults.stream_status
        if code != grpc.StatusCode.OK:
            await self._fail(context, self.faults.stream_status)

    def _step(self, request: pb.StepRequest) -> pb.StepResponse:
        actions = np.asarray(codec.decode_value(request.actions, "actions"))
        obs, rewards, terminations, truncations, _ = self.env.step(actions)
        response = pb.StepResponse(env_seconds=1e-6, step_id=request.step_id if self.faults.echo_step_id else 0)
        codec.encode_value(obs, response.observations, "observations")
        codec.encode_tensor(np.asarray(rewards, dtype=np.float64), response.rewards, "rewards")
        codec.encode_tensor(np.asarray(terminations, dtype=np.bool_), response.terminations, "terminations")
        codec.encode_tensor(np.asarray(truncations, dtype=np.bool_), response.truncations, "truncations")
        codec.encode_value({}, response.infos, "infos")
        return response

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        self._released.setdefault(request.session_id, asyncio.Event()).set()
        self._live.discard(request.session_id)
        self.released.append(request.session_id)
        return pb.ReleaseResponse()


class FaultyServer:
    """The server, running on its own event loop in a thread while the ``with`` block lasts:
    ``with FaultyServer(Faults(...)) as server: RemoteVectorEnv([server.address])``."""

    def __init__(self, faults: Faults | None = None, num_envs: int = 2) -> None:
        self.service = _Service(faults or Faults(), num_envs)
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-server", daemon=True)
        self._server: grpc.aio.Server | None = None

    @property
    def faults(self) -> Faults:
        return self.service.faults

    def __enter__(self) -> FaultyServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_EnvServiceServicer_to_server(self.service, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    def __exit__(self, *exc_info: Any) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self.service.env.close()
