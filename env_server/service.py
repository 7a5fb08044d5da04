"""The EnvService servicer: sessions, reset and step, and the one place exceptions become status codes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import queue
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import gymnasium as gym
import numpy as np

from env_server import codec
from env_server.config import ServerConfig
from env_server.envs import EnvBuildError, ObservationLayoutError, env_kwargs_json, max_episode_steps
from env_server.interceptors import MalformedRequest, RefusalLog, refuse
from env_server.isolation import ENV_ERROR_KEY, NO_OPTIONS_KEY, ONE_THREAD_KEY
from env_server.metrics import ServerMetrics
from env_server.protocol import (
    AUTH_METADATA_KEY,
    ENV_INDEX_KEY,
    ERROR_ORIGIN_KEY,
    ERROR_ORIGIN_SERVER,
    MAX_MESSAGE_BYTES,
    NOT_OWNED,
    PROTOCOL_VERSION,
    SERVICE_NAME,
    SHUTDOWN_REASON,
    SHUTTING_DOWN_MESSAGE,
    escape_surrogates,
    peer_text,
    runtime_versions,
)
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.validation import InvalidActionError, check_actions

__all__ = [
    "ANSWER_HEADROOM",
    "HANDSHAKE_METHOD",
    "SPEC_ROOM",
    "AnswerHandshakes",
    "EnvService",
    "ServiceError",
    "shutting_down",
    "space_bytes",
]

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error to send as a gRPC status: ``code`` and a message a person can act on."""

    def __init__(self, code: grpc.StatusCode, message: str, env_index: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.env_index = env_index


@dataclass
class Session:
    """One learner's claim on the server's envs."""

    id: str
    peer: str
    client_name: str
    created: float
    last_seen: float
    holds: int = 0
    calls: int = 0
    """Its env calls under way (a Reset, a Step, waiting for the envs or running): not silence, however
    long they take (see EnvService._live_claim)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end_reason: str = ""
    used: bool = False
    """Whether any call has named the session (Hold, Reset, Step; on gRPC or the step socket): its
    client got the Handshake's answer."""
    answer_bytes: int = 0
    """The size of the Handshake's answer that opened it (what a client must be able to receive)."""
    answering: bool = False
    """Whether that answer is being sent (over a slow link, or one the client refused meanwhile)."""

    def describe(self, now: float | None = None) -> str:
        """Who holds the session, and (given ``now``) since when."""
        who = f"{self.client_name!r} from {self.peer}" if self.client_name else f"a client from {self.peer}"
        since = "" if now is None else f", claimed {now - self.created:.1f} s ago"
        return f"{who} (session {self.id[:8]}{since})"


# Env calls expected to take less than this run with the event loop waiting for them: on the loop itself,
# or handed to the env thread for envs bound to one thread (EnvThread.call, ~20-40 us more; see
# one_thread); slower ones are awaited on the env thread, the loop free meanwhile (the hop through the loop
# costs ~50-100 us, a third of a whole CartPole round trip), while a call the loop waits for delays health
# checks and refusals by its duration: 10 ms is harmless there, and the hop is then at most 1%.
INLINE_LIMIT_S = 0.010
# Longest a shutdown keeps an idle step stream open (see StepStream), within the grace period.
_DRAIN_LINGER_S = 1.0
# Weight of the newest call in the moving average of env call durations.
_EWMA_WEIGHT = 0.2
# An env call at least this slow keeps its kind's calls off the loop for the next _REMEMBER_S, whatever
# the moving average says (which forgets a 3-s step within ~19 quick ones): an env slow now and then (a
# level loaded at each episode's start, a periodic save) holds the loop up at its first slow call only,
# not at each. Ten times INLINE_LIMIT_S: a loaded machine's hiccups stay under it.
_REMEMBERED_CALL_S = 0.1
_REMEMBER_S = 60.0
# What an answer (Step's, Reset's) holds besides its observations' data (framing, rewards, flags, infos):
# kept free by the server's check at start (server._check_answer_size), which the observations alone pass.
ANSWER_HEADROOM = 1024 * 1024
# What the answers to GetSpec and Handshake hold besides the spec (a session id, who holds the server, the
# step socket's path, framing): a few hundred bytes, kept free. The spec may take the rest.
_SPEC_HEADROOM = 4 * 1024
SPEC_ROOM = MAX_MESSAGE_BYTES - _SPEC_HEADROOM
# What a step is told when the envs need a full reset first (unless it is told why: see _step_unseen).
_RESET_FIRST = "Step called before Reset: reset the envs first"


_GAVE_UP = "caller gave up on it (its deadline passed, or it was cancelled) before its answer came"


def _step_unseen(why: str) -> str:
    """What a step is told after one whose answer its client did not get (``why``), which the envs took."""
    return (
        f"the envs stepped for an earlier Step whose {why}, so they are not where this session last saw them: "
        "reset them first (a full reset); nothing was stepped"
    )


def _reset_unseen(why: str) -> str:
    """What a step is told after a Reset whose answer its client did not get (``why``), which the envs took."""
    return (
        f"the envs were reset for an earlier Reset whose {why}, so they are not where this session last saw them: "
        "reset them again (a full reset); nothing was stepped"
    )


# Why a Step's or Reset's answer did not reach its client, when the server could not build it (the
# env returned what the wire cannot carry, say): the error that call got said what.
_UNBUILT = "answer could not be built (that call's error said why)"


class _AnswerTooLarge(ServiceError):
    """An answer over the size a message may take (see EnvService._check_answer_bytes)."""


T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _rpc(
    method: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[..., Awaitable[Resp | None]]:
    """Turn exceptions raised by a unary handler into status codes (the one place this happens)."""

    @functools.wraps(method)
    async def wrapper(self: EnvService, request: Req, context: grpc.aio.ServicerContext) -> Resp | None:
        try:
            return await method(self, request, context)
        except Exception as err:
            self.end_call(context, err, method.__name__, request)
        return None  # (gRPC sends no message when the status is not OK)

    return wrapper


class _Call:
    """A call :meth:`EnvThread.call` hands over: its outcome, and a lock released once it is in."""

    __slots__ = ("args", "done", "error", "finished", "fn", "kwargs", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Lock()
        self.done.acquire()
        self.finished = False  # (set before done is released: see _wait_finished)
        self.result: Any = None
        self.error: BaseException | None = None

    def __call__(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as err:  # (raised on in the caller's thread)
            self.error = err
        finally:
            self.finished = True
            self.done.release()


class _Job:
    """A call :meth:`EnvThread.submit` queued, and the future of its outcome."""

    __slots__ = ("args", "fn", "future", "kwargs")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        future: concurrent.futures.Future[Any],
    ) -> None:
        self.fn, self.args, self.kwargs, self.future = fn, args, kwargs, future

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as err:
            self.future.set_exception(err)
            del err  # (no cycle through its traceback)
        else:
            self.future.set_result(result)


class EnvThread(concurrent.futures.Executor):
    """The one thread that runs every call on the envs: building them, reset, step, telling them their
    places, closing them. Envs may hold state bound to the thread that made it (an EGL context
    current on it, a sqlite3 connection, an event loop of their own for ``asyncio.run``), as
    gymnasium's vector envs, which call their envs from one thread, let them.

    Two ways in, to the same thread, one call at a time: :meth:`call` hands a call over and blocks
    the calling thread (the event loop: a quick call, ~20-40 us more than running it there) until it
    returns; :meth:`submit` (an executor's, for ``loop.run_in_executor``) queues it, and its future
    says when it is done. Whatever the call raises (any BaseException: an env's own
    ``asyncio.CancelledError`` too) is raised (set) as its outcome. The thread starts at the first call
    (after async vectorization's fork). As a ThreadPoolExecutor's, it is no daemon thread (nor are the
    threads an env starts on it), and the interpreter's exit ends it once its call is done."""

    def __init__(self, name: str = "env") -> None:
        self._name = name
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._shut_down = False
        self.ident = 0
        """The thread's ``threading.get_ident()`` once it has started (0 before)."""

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the env thread, waited for here; what it raises is raised here."""
        if threading.get_ident() == self.ident:  # (from the env thread itself: a call would wait for itself)
            return fn(*args, **kwargs)
        task = _Call(fn, args, kwargs)
        self._put(task)
        try:
            task.done.acquire()
        except BaseException:
            # (a signal handler's exception, raised in this thread while it waited: the call goes on, and
            # no other may start on the envs before it ends)
            _wait_finished(task)
            raise
        error, task.error = task.error, None  # (no cycle through its traceback)
        if error is not None:
            raise error
        return task.result

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(_Job(fn, args, kwargs, future))
        return future

    def _put(self, task: Callable[[], None]) -> None:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("the env thread has been shut down: no more env calls")
            if self._thread is None:
                thread = threading.Thread(target=self._work, name=self._name, daemon=False)
                thread.start()
                self._thread = thread
                self.ident = thread.ident or 0
                # (as concurrent.futures does for its threads: run before the interpreter waits for them)
                register = getattr(threading, "_register_atexit", None)
                if register is not None:
                    with contextlib.suppress(RuntimeError):  # (the interpreter is already on its way out)
                        register(functools.partial(self.shutdown, wait=False))
            self._tasks.put(task)

    def _work(self) -> None:
        tasks = self._tasks
        while True:
            task = tasks.get()
            if task is None:
                return
            task()
            del task

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; the thread ends once the calls queued before are done (with ``cancel_futures``:
        those not yet begun are cancelled), waited for if ``wait``."""
        with self._lock:
            if not self._shut_down:
                self._shut_down = True
                if cancel_futures:
                    kept = []  # (calls waited for: not cancellable, they run first)
                    with contextlib.suppress(queue.Empty):
                        while True:
                            task = self._tasks.get_nowait()
                            if isinstance(task, _Job):
                                task.future.cancel()
                            elif task is not None:
                                kept.append(task)
                    for task in kept:
                        self._tasks.put(task)
                self._tasks.put(None)
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


def _wait_finished(task: _Call) -> None:
    """Wait for ``task`` to be done, whatever exceptions signal handlers raise meanwhile (one raised just after
    its lock was taken leaves the lock held by this thread: its flag, not the lock, says it is done)."""
    while not task.finished:
        with contextlib.suppress(BaseException):
            task.done.acquire(timeout=0.05)


def one_thread(env: gym.vector.VectorEnv) -> bool:
    """Whether every call on ``env``'s envs must come from one thread, the env thread: envs that render (a
    ``render_mode``: an OpenGL context, EGL's or OSMesa's, is current on the thread that made it; MuJoCo's
    frames under MUJOCO_GL=egl were all zeros once steps ran elsewhere), or that say so in their metadata
    (:data:`ONE_THREAD_KEY`: an sqlite3 connection, an ``asyncio.run`` in step). Other envs' quick calls run on
    the event loop itself, as gymnasium's vector envs call theirs from whatever thread steps them."""
    metadata = getattr(env, "metadata", None) or {}
    return getattr(env, "render_mode", None) is not None or bool(metadata.get(ONE_THREAD_KEY))


class EnvService(pb_grpc.EnvServiceServicer):
    """Serves one vector env to one learner at a time.

    The service exists before its envs: until :meth:`attach` gives it the vector env (the server
    builds it while already answering health checks with NOT_SERVING), every call gets UNAVAILABLE.
    """

    def __init__(self, config: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        self._config = config
        self._metrics = metrics
        # The process's id for learners (its spec's) and its metrics (from the start: a fleet's servers
        # still building would otherwise share one, "", which a dashboard's join on it refuses).
        self.server_id = secrets.token_hex(8)
        if metrics is not None:
            metrics.set_server_id(self.server_id)
        self._env: gym.vector.VectorEnv | None = None
        self._num_envs = 0
        self._claim: Session | None = None
        self._refusals = RefusalLog()  # calls answered with an error status (their log lines are rate-limited)
        # Handshakes that carried a token while this server checks none (logged as rarely).
        self._unchecked_tokens = RefusalLog(what="handshakes with a token this server does not check")
        self._needs_reset = True
        # What a step refused for want of a reset is told (why the envs need one).
        self._reset_why = _RESET_FIRST
        # Under autoreset Disabled, the envs that ended at their last step and wait for a reset: a step
        # refused before it reaches gymnasium (whose assertion would cost the session a full reset).
        self._ended: np.ndarray | None = None
        # Why the envs cannot run any more (an async vector env whose workers ended), or None.
        self._dead: str | None = None
        self.on_dead: Callable[[], None] | None = None
        """Called once when the envs cannot run any more, from the thread of the env call that found
        it (the server turns its health NOT_SERVING)."""
        self.on_session_end: Callable[[str, str], None] | None = None
        """Called with a session's id and why it ended, on the loop, whenever a session ends (released,
        its Hold stream gone, timed out, the server shutting down): the step socket closes that
        session's connections, which would otherwise stay open for as long as their process lives."""
        # Env calls run one at a time (the lock): while they are quick, on the loop (or, for envs bound to
        # one thread, on the env thread with the loop waiting: see one_thread), else on the env thread,
        # awaited, the loop free to answer health checks, refusals and releases (see INLINE_LIMIT_S).
        self._env_lock = asyncio.Lock()
        self._env_thread = EnvThread("env")
        # Moving average of each env call's duration (step, reset, ...), unknown until the first:
        # so a first call runs on the env thread (a robot's slow first step does not hold the loop up).
        self._env_seconds: dict[str, float] = {}
        # When each kind's last call of _REMEMBERED_CALL_S or more ended (time.monotonic()).
        self._slow_at: dict[str, float] = {}
        self._one_thread = True  # (as of attach: see one_thread)
        # Info values no wire form carries, sent as their repr (warned once per info key).
        self._unsendable_infos = UnsendableInfos()
        # The env call under way (step, reset), when it started (time.monotonic(); 0: none) and the thread it
        # runs on (threading.get_ident(): the env thread's), for the server's watchdog thread
        # (its warning of a slow call says where it is stuck; --hang-timeout).
        self.call_kind = ""
        self.call_started = 0.0
        self.call_thread = 0
        self.slow_call = 0.0
        """The ``call_started`` of the call the watchdog warned of as slow: its end is logged too."""
        # StepStream calls waiting for their next request (not stepping): ended at once on shutdown.
        self._idle_streams: set[asyncio.Task[Any]] = set()
        # How long a shutdown leaves an idle step stream open for a request already on its way.
        self._drain_linger_s = min(_DRAIN_LINGER_S, config.grace_s)
        self.step_socket = ""  # the step socket's path, once the server listens on one
        self.draining = False
        self.spec: pb.EnvSpec | None = None
        """The spec as a client that reads compact Box bounds gets it (accepts_compact_bounds)."""
        # The spec with every Box bound at full shape, for clients that do not (learners older than compact
        # bounds): ``spec`` itself where no bound is compact; None where it would not fit an answer, whose
        # size (or the least it would take) ``full_spec_bytes`` says, or where it is not built yet: where it
        # surely fits, it is built at the first request for it (``_full_spec_later``: the spaces it describes),
        # not at start (twice an observation for learners that may never come; ``full_spec_bytes`` is then the
        # least it takes, under the room, until built).
        self._full_spec: pb.EnvSpec | None = None
        self._full_spec_later: tuple[gym.Space[Any], gym.Space[Any]] | None = None
        self.full_spec_bytes = 0
        self._observation_bytes = 0
        self.steps = 0
        self.build_envs: Callable[[], gym.vector.VectorEnv] | None = None
        """Builds the envs anew, as the server built them at start (run on the env thread): with
        ``--fresh-envs``, the server sets it, and a new learner's Handshake rebuilds them (see _fresh_envs)."""
        # Whether the envs have run a call (reset, step) since they were built: a new session's are then not
        # fresh. The last session that held them (its id) and how it ended (its metrics kind): a Handshake
        # that says it rejoins that session is its learner's, which keeps its envs (see _fresh_envs).
        self._envs_ran = False
        self._last_session: tuple[str, str] = ("", "")
        # Who the envs are being built anew for, while they are (a Handshake's learner); "" otherwise.
        self._rebuilding = ""
        # Why the envs' last rebuild failed ("" if it did not): they were closed, none serve until one succeeds.
        self._rebuild_failed = ""
        self._said_envs_go_on = False  # (without --fresh-envs: said once that a new session's envs go on)

    def attach(self, env: gym.vector.VectorEnv) -> None:
        """Serve ``env`` from now on (once; the server calls it when the envs are built)."""
        self._env = env
        self._num_envs = env.num_envs
        self._obs_space = env.single_observation_space
        self._act_space = env.single_action_space
        # (what the observations of an answer take at most: see _check_answer_bytes)
        self._observation_bytes = space_bytes(self._obs_space) * self._num_envs
        self._one_thread = one_thread(env)
        self.spec = self._make_spec(compact=True)
        self._full_spec, self._full_spec_later = None, None
        least = _full_bounds_bytes(self._obs_space) + _full_bounds_bytes(self._act_space)
        self.full_spec_bytes = least
        # Built now only where it may not fit (its size then known exactly from the start, for the server's
        # warning and the refusals): not where its bounds alone would not (a 50 MB camera's: 100 MB for nothing),
        # nor where it surely fits (built at the first request for it: see _spec_for).
        if least <= SPEC_ROOM:
            if _full_spec_most(self._obs_space, self._act_space, self.spec) <= SPEC_ROOM:
                self._full_spec_later = (self._obs_space, self._act_space)
            else:
                self._full_spec = self._make_full_spec(self._obs_space, self._act_space)

    def _make_full_spec(self, obs_space: gym.Space[Any], act_space: gym.Space[Any]) -> pb.EnvSpec | None:
        """The spec with full-shape bounds (see ``_full_spec``) of ``obs_space`` and ``act_space`` (those of the
        envs ``spec`` describes), the rest as in ``spec`` (its versions included); None where it does not fit an
        answer (``full_spec_bytes`` says its size in both cases)."""
        assert self.spec is not None
        full = pb.EnvSpec()
        full.CopyFrom(self.spec)
        full.ClearField("observation_space")
        full.ClearField("action_space")
        codec.encode_space(obs_space, full.observation_space, "observation_space")
        codec.encode_space(act_space, full.action_space, "action_space")
        self.full_spec_bytes = full.ByteSize()
        if self.full_spec_bytes > SPEC_ROOM:
            return None
        return self.spec if full == self.spec else full  # (one copy where nothing is compact)

    def _spec_for(self, compact: bool, request: str) -> pb.EnvSpec:
        """The spec to answer a ``request`` (its name) with, which ``compact`` says accepts_compact_bounds set
        or not; FAILED_PRECONDITION where that is the full-shape one and it does not fit an answer."""
        assert self.spec is not None  # (the envs are attached: callers checked)
        if compact:
            return self.spec
        if self._full_spec_later is not None:  # (the first request for it: see _full_spec)
            self._full_spec = self._make_full_spec(*self._full_spec_later)
            self._full_spec_later = None
        if self._full_spec is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server's spec takes {self.full_spec_bytes:,} bytes with its Box bounds at full shape, over "
                f"the {SPEC_ROOM:,} an answer leaves it (64 MiB less 4 KiB), and the {request} did not set "
                f"accepts_compact_bounds, which gets it in {self.spec.ByteSize():,} bytes (a bound that is the same "
                "in every element sent as one value): upgrade the learner (envfleet learners set it since "
                "2026-12-07), or have the client read compact bounds (see BoxSpace.shape in env.proto)",
            )
        return self._full_spec

    @property
    def env(self) -> gym.vector.VectorEnv:
        """The vector env served; UNAVAILABLE (a ServiceError) while it is being built (shutting down, if
        the server was stopped meanwhile: it closes the envs once built, and serves none)."""
        if self._env is None:
            if self.draining:
                raise shutting_down()
            if self._rebuild_failed:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, self._rebuild_failed)
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, "the server is starting: its envs are being built; try again shortly"
            )
        return self._env

    def _check_ready(self) -> None:
        """UNAVAILABLE while the envs are being built at start (not after a rebuild that failed: the server
        serves its spec, and a Handshake builds them again; see _fresh_envs)."""
        if not self._rebuild_failed:
            self.env  # noqa: B018 (the property raises)

    @property
    def served_env(self) -> gym.vector.VectorEnv | None:
        """The vector env served now: the one attached last (``--fresh-envs`` builds them anew), None where
        its rebuild failed (the envs were closed) or the service was detached."""
        return self._env

    def _make_spec(self, *, compact: bool = False) -> pb.EnvSpec:
        """The spec of the envs attached; ``compact``: Box bounds of one value as that value (codec.encode_space)."""
        env = self.env
        spec = pb.EnvSpec(
            protocol_version=PROTOCOL_VERSION,
            env_id=self._config.env,
            num_envs=self._num_envs,
            autoreset_mode=codec.AUTORESET_TO_PROTO[
                gym.vector.AutoresetMode(env.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP))
            ],
            render_modes=[str(m) for m in env.metadata.get("render_modes", []) or []],
            server_id=self.server_id,
            vectorization=self._config.vectorization,
            wrappers=list(self._config.wrappers),
            max_episode_steps=max_episode_steps(env, self._config),
            versions=_versions(),
            env_kwargs=env_kwargs_json(self._config),
        )
        codec.encode_space(self._obs_space, spec.observation_space, "observation_space", compact=compact)
        codec.encode_space(self._act_space, spec.action_space, "action_space", compact=compact)
        fps = env.metadata.get("render_fps")
        if fps is not None:
            spec.render_fps = float(fps)
        return spec

    # -- errors ---------------------------------------------------------------------------------

    def status(
        self,
        err: Exception,
        method: str,
        *,
        peer: str = "",
        session_id: str = "",
        client_name: str = "",
        context: grpc.aio.ServicerContext | None = None,
    ) -> tuple[grpc.StatusCode, str, int | None]:
        """The status ``err`` means (code, message, env index or None): the one place exceptions become
        status codes, for gRPC calls and the step socket alike. The refusal is counted and logged, and
        ends the call of ``context``, if given (see interceptors.refuse).

        ``peer``, ``session_id`` and ``client_name`` (a Handshake's) say who called, for the log line."""
        env_index: int | None = None
        if isinstance(err, ServiceError):
            code, message, env_index = err.code, str(err), err.env_index
        elif isinstance(err, codec.CodecError):
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        else:  # never let an exception reach a client as UNKNOWN
            log.exception("%s failed", method)
            code, message = grpc.StatusCode.INTERNAL, f"{method} failed: {type(err).__name__}: {err}"
        # (an env's error may hold a lone surrogate, which gRPC's status and the step socket's frame cannot carry)
        message = escape_surrogates(message)
        line = None  # (INTERNAL: logged as it happened)
        if code is not grpc.StatusCode.INTERNAL:
            caller = self._describe_caller(peer, session_id, client_name)
            line = ("refused %s%s [%s]: %s", method, caller, code.name, message)
        # (UNAVAILABLE: starting or shutting down, which the server logs anyway; Hold: a learner's
        # session that ended before its Hold stream came, closed at once, say: its next call is told)
        quiet = code is grpc.StatusCode.UNAVAILABLE or method == "Hold"
        trailer: tuple[tuple[str, str], ...] = ((ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER),)
        if env_index is not None:
            trailer += ((ENV_INDEX_KEY, str(env_index)),)
        refuse(
            context,
            code,
            message,
            refusals=self._refusals,
            kind=method,
            line=line,
            count=None if self._metrics is None else functools.partial(self._metrics.count_error, method, code.name),
            level=logging.INFO if quiet else logging.WARNING,
            logger=log,
            trailing_metadata=trailer,
        )
        return code, message, env_index

    def _describe_caller(self, peer: str, session_id: str, client_name: str) -> str:
        """Who called, for a refusal's log line: `` from PEER ('name')``, as far as known (the client's
        name is its Handshake's, or that of the session it names if that is the live one)."""
        claim = self._claim
        if not client_name and session_id and claim is not None and _same_id(claim.id, session_id):
            client_name = claim.client_name
        text = f" from {peer}" if peer else ""
        return f"{text} ({client_name[:200]!r})" if client_name else text

    def end_call(self, context: grpc.aio.ServicerContext, err: Exception, method: str, request: object = None) -> None:
        """Set the status ``err`` means on the call (of ``request``, where one was read); the handler
        then returns, with no response (not ``context.abort()``, which kept refused requests in
        memory: see interceptors.end_call)."""
        self.status(
            err,
            method,
            peer=peer_text(context.peer()),
            session_id=getattr(request, "session_id", ""),
            client_name=getattr(request, "client_name", ""),
            context=context,
        )

    # -- sessions ---------------------------------------------------------------------------------

    def _live_claim(self, now: float) -> Session | None:
        claim = self._claim
        if claim is None:
            return None
        # (not while its Handshake's answer is being written: a large one over a slow link takes a while;
        # nor while one of its calls runs: a slow reset is no silence, and its silence counts from its end)
        silent = claim.holds == 0 and claim.calls == 0 and not claim.answering
        if silent and now - claim.last_seen > self._config.claim_timeout_s:
            self._end(claim, f"no Hold stream and no calls for {self._config.claim_timeout_s:g} s", "claim_timeout")
            return None
        return claim

    async def expire_claims(self) -> None:
        """End the claim once it has had no Hold stream and no calls for the claim timeout, whether or
        not anyone calls meanwhile (calls check it too); runs until cancelled (the server starts it
        with its envs and cancels it on shutdown)."""
        interval = min(1.0, max(self._config.claim_timeout_s / 2, 0.05))
        while True:
            await asyncio.sleep(interval)
            self._live_claim(time.monotonic())

    def _end(self, session: Session, reason: str, kind: str, level: int = logging.INFO) -> None:
        """End ``session`` for ``reason`` (said in the log, at ``level``, and to its Hold stream);
        ``kind`` is the reason's label in the metrics, one of env_server.metrics.SESSION_END_REASONS."""
        if self._claim is session:
            self._claim = None
            if self._metrics is not None:
                self._metrics.session_ended(kind)
            # (the client's name too: over a Unix socket every peer is "unix:", the same for all learners on the host)
            who = f"{session.client_name!r} from {session.peer}" if session.client_name else session.peer
            log.log(level, "session %s of %s ended: %s", session.id[:8], who, reason)
            if kind != "unanswered":  # (no client knew that session: none can rejoin it, see _fresh_envs)
                self._last_session = (session.id, kind)
            if self.on_session_end is not None:
                self.on_session_end(session.id, reason)
        session.end_reason = reason
        session.ended.set()

    def _session(self, session_id: str) -> Session:
        # (first: while the envs are being built, every EnvService call is UNAVAILABLE, a server starting;
        # no session exists yet, and "does not own this server" would say nothing of that)
        self._check_ready()
        if self.draining:
            raise shutting_down()
        if not session_id:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session_id: expected the session id a Handshake returned, got an empty one, which {NOT_OWNED}; "
                "call Handshake first and send its answer's session_id in every later request",
            )
        now = time.monotonic()
        claim = self._live_claim(now)
        if claim is None or not _same_id(claim.id, session_id):
            raise _not_owned(
                session_id, "it was released, its connection dropped, it timed out, or the server restarted"
            )
        claim.last_seen = now
        claim.used = True
        return claim

    def owns(self, session_id: str) -> bool:
        """Whether ``session_id`` is the live session's (a claim past its timeout ends here, as at any call)."""
        claim = self._live_claim(time.monotonic())
        return claim is not None and _same_id(claim.id, session_id)

    def end_all(self, reason: str) -> None:
        """End the current session (server shutdown)."""
        if self._claim is not None:
            self._end(self._claim, reason, "shutdown")

    # -- RPCs ---------------------------------------------------------------------------------------

    @_rpc
    async def GetSpec(self, request: pb.GetSpecRequest, context: grpc.aio.ServicerContext) -> pb.GetSpecResponse:
        self._check_ready()
        now = time.monotonic()
        claim = self._live_claim(now)
        return pb.GetSpecResponse(
            # (server_id_only: a learner telling servers apart, without a camera's bounds at every probe)
            spec=(
                pb.EnvSpec(server_id=self.server_id)
                if request.server_id_only
                else self._spec_for(request.accepts_compact_bounds, "GetSpecRequest")
            ),
            claimed_by=claim.describe(now) if claim is not None else "",
            # (`learner servers` shows it, where it would otherwise call the server free)
            note=f"no envs: {self._rebuild_failed}" if self._rebuild_failed else "",
        )

    @_rpc
    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        # (the server serves it through answer_handshake, which sends the answer)
        self._check_ready()
        if self.draining:
            raise shutting_down()
        if request.protocol_version not in (0, PROTOCOL_VERSION):
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol_version: this server speaks envfleet.v{PROTOCOL_VERSION}, the client asked for "
                f"{request.protocol_version}; upgrade the older side",
            )
        self._spec_for(request.accepts_compact_bounds, "HandshakeRequest")  # (refused before anything is claimed)
        now = time.monotonic()
        owner = self._live_claim(now)
        if owner is not None:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this server's envs are claimed by {owner.describe(now)}; one learner owns a server at a "
                "time. The claim ends when that learner closes, its connection drops, or after "
                f"{self._config.claim_timeout_s:g} s of silence"
                + (" (a call of its is under way: silence counts from its end)" if owner.calls else "")
                + self._unused_note(owner, now),
            )
        if self._rebuilding:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"this server's envs are being built anew (--fresh-envs) for {self._rebuilding}, whose Handshake "
                "claims them next; try again shortly",
            )
        if _deadline_passed(context):
            # (its answer could not be sent: a claim now would lock out the client's retries until it timed out)
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the call's deadline passed before the server could answer it; nothing was claimed",
            )
        session_id, client_name, peer = secrets.token_hex(16), request.client_name[:200], peer_text(context.peer())
        if await self._fresh_envs(session_id, client_name, peer, request.rejoins_session_id):
            if self.draining:
                raise shutting_down()
            now = time.monotonic()
            if _deadline_passed(context):
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the call's deadline passed while the server built its envs anew for it (--fresh-envs); nothing "
                    "was claimed: the next Handshake finds them fresh",
                )
        session = Session(id=session_id, peer=peer, client_name=client_name, created=now, last_seen=now)
        self._claim = session
        self._require_reset()
        if self._metrics is not None:
            self._metrics.session_started()
        log.info("claimed by %s", session.describe())
        checks_token = self._config.auth_token is not None
        if not checks_token and _carries_token(context):
            self._note_unchecked_token(session)
        response = pb.HandshakeResponse(
            session_id=session.id,
            spec=self._spec_for(request.accepts_compact_bounds, "HandshakeRequest"),
            claim_timeout_s=self._config.claim_timeout_s,
            step_socket=self.step_socket,
            max_request_bytes=self._config.max_request_bytes,
            checks_token=checks_token,
            client_certificates_required=self._config.tls_client_ca is not None,
        )
        session.answer_bytes = response.ByteSize()
        return response

    async def _fresh_envs(self, session_id: str, client_name: str, peer: str, rejoins: str = "") -> bool:
        """Before a Handshake claims the envs for session ``session_id`` (of ``client_name`` at ``peer``, which
        says it ``rejoins`` a session of its learner's, or ""):
        with ``--fresh-envs``, build them anew where they ran in an earlier session, so that this one starts
        from envs as fresh as the first session's (what the envs and their wrappers keep: NormalizeObservation's
        statistics, say); without, say once that they go on. Whether they were built anew.

        Not for envs that no call has run since they were built, nor for a learner that rejoins the last
        session that held them (HandshakeRequest.rejoins_session_id: its reconnect after a network cut or a
        hang, however that session ended, released by the reconnect itself included, goes on with its envs'
        state), nor for envs whose async workers ended (every env call says to restart the server). A learner's
        name says nothing of that (a notebook's new RemoteVectorEnv, in the same process as the one it
        replaces, is a new learner). The old envs are closed, then the new ones
        built as at start, on the env thread, the envs' lock held (no env call meanwhile; other Handshakes are
        told to try again shortly). A rebuild that fails leaves no envs (the old ones closed, nothing of the
        new ones kept) and raises INTERNAL naming its error; the server serves on, and the next Handshake
        builds them again."""
        if self._env is not None:
            if not self._envs_ran or self._dead is not None:
                return False
            last_id, last_end = self._last_session
            if rejoins and last_id and _same_id(last_id, rejoins):
                if self._config.fresh_envs:
                    log.info(
                        "fresh envs: not rebuilt for session %s: its learner rejoins its last session %s (ended: %s), "
                        "whose envs' state goes on",
                        session_id[:8],
                        last_id[:8],
                        last_end,
                    )
                return False
            if not self._config.fresh_envs or self.build_envs is None:
                if not self._said_envs_go_on:
                    self._said_envs_go_on = True
                    log.info(
                        "session %s: the envs go on from the last session, their wrappers' state included "
                        "(--fresh-envs rebuilds them for each new learner)",
                        session_id[:8],
                    )
                return False
        if self.build_envs is None:  # (no rebuild: a service the server did not set up for one)
            return False
        who = f"session {session_id[:8]} (" + (f"{client_name!r} from {peer})" if client_name else f"from {peer})")
        self._rebuilding = who
        started = time.perf_counter()
        try:
            async with self._env_lock:  # (an env call of an earlier session may still run: waited for)
                old, old_spec, old_full = (
                    self._env,
                    self.spec,
                    (self._full_spec, self._full_spec_later, self.full_spec_bytes),
                )
                future = asyncio.get_running_loop().run_in_executor(self._env_thread, self._build_anew, old)
                # (the Handshake cancelled meanwhile: the build goes on, and is kept)
                cancelled = await _wait_uncancellable(future)
                error = future.exception()
                new = None
                if error is None:
                    try:
                        new = future.result()
                        self.attach(new)
                        if old_spec is not None and not _same_envs(self.spec, old_spec):
                            raise ValueError(
                                "the envs built anew differ from those the server started with (their spaces, "
                                "number, time limit or metadata), which learners already hold: the env's factory "
                                "must build the same envs every time"
                            )
                    except Exception as err:
                        error = err
                if error is None:
                    self._envs_ran, self._rebuild_failed = False, ""
                    if self._metrics is not None and not self.draining:
                        self._metrics.ready.set(1)
                else:
                    self._env = None  # (the old envs were closed; new ones that cannot serve are closed below)
                    if old_spec is not None:
                        self.spec, (self._full_spec, self._full_spec_later, self.full_spec_bytes) = old_spec, old_full
                    what = str(error) if isinstance(error, EnvBuildError) else f"{type(error).__name__}: {error}"
                    self._rebuild_failed = (
                        f"the server could not build its envs anew for a new session (--fresh-envs): {what}; it "
                        "serves on, with no envs until a Handshake builds them: try again"
                    )
                    # No envs serve (envfleet_ready 0; `learner servers` says why, see GetSpec), but health
                    # stays SERVING: a readiness probe would otherwise keep away the Handshake that builds them.
                    if self._metrics is not None:
                        self._metrics.ready.set(0)
                    if new is not None:
                        with contextlib.suppress(Exception):
                            await self.run_in_env_thread(new.close)
        finally:
            self._rebuilding = ""
        elapsed = time.perf_counter() - started
        if self._metrics is not None:
            self._metrics.env_rebuilds.labels("ok" if error is None else "failed").inc()
        if error is not None:
            log.error("fresh envs for %s: rebuild failed after %.2f s: %s", who, elapsed, self._rebuild_failed)
            if cancelled:
                raise asyncio.CancelledError
            raise ServiceError(grpc.StatusCode.INTERNAL, self._rebuild_failed)
        if self._metrics is not None:
            self._metrics.env_build_seconds.set(elapsed)
        log.info("fresh envs for %s: rebuilt in %.2f s", who, elapsed)
        if cancelled:
            raise asyncio.CancelledError
        return True

    def _build_anew(self, old: gym.vector.VectorEnv | None) -> gym.vector.VectorEnv:
        """Close ``old`` (the envs served, if any) and build the envs anew, on the env thread (see _fresh_envs):
        an env call as the watchdog sees it (its slow-call warning, --hang-timeout, the shutdown's message)."""
        begun, start = self._call_begins("rebuild")
        try:
            if old is not None:
                try:
                    old.close()
                except Exception as err:  # (the env's own close: its envs are let go of all the same)
                    log.warning(
                        "fresh envs: the old envs' close raised (%s: %s); building anew all the same",
                        type(err).__name__,
                        err,
                    )
            assert self.build_envs is not None
            return self.build_envs()
        finally:
            self._call_ends("rebuild", begun, start)

    def _call_begins(self, kind: str) -> tuple[float, float]:
        """An env call of ``kind`` (step, reset, rebuild) begins in this thread, for the server's watchdog (its
        warning of a slow call, --hang-timeout, the shutdown's message): when, as ``(time.monotonic(),
        time.perf_counter())``, for :meth:`_call_ends`. (Two calls, not a context manager: on every step.)"""
        begun = time.monotonic()
        self.call_kind, self.call_started, self.call_thread = kind, begun, threading.get_ident()
        return begun, time.perf_counter()

    def _call_ends(self, kind: str, begun: float, start: float) -> float:
        """The env call :meth:`_call_begins` said began has ended: its seconds (said in the log where the watchdog
        had warned of it)."""
        self.call_started = 0.0
        elapsed = time.perf_counter() - start
        if self.slow_call == begun:
            log.info("the envs' %s returned after %.1f s", kind, elapsed)
        return elapsed

    async def answer_handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> None:
        """Handshake as the server serves it (see AnswerHandshakes): the answer written here, one
        message, as a unary call's is on the wire (a refusal, sent before any message, goes as gRPC's
        "Trailers-Only" form, status in the headers, which every gRPC client reads as a unary call's
        refusal), so that the claim can be given up when it could not be sent.

        gRPC sends a unary handler's answer after the handler has returned, and tells the handler
        nothing when that fails (the call's deadline passed, the client cancelled it, or reset the
        stream: gRPC clients do when an answer is over their max receive message length); it logs a
        traceback that says none of that ("ExecuteBatchError raised in core by servicer method"). The
        claim would then stay, with no client knowing its session: the client's retries refused for
        the whole claim timeout, and no one able to Release it. A write that fails says so here.
        (One that succeeds may still not reach the client, when the client refuses a small answer
        or its deadline passes while the answer travels: the refusal of its retry then says what may
        have happened, see _unused_note.)"""
        response = await self.Handshake(request, context)
        if response is None:  # (refused: the status is set)
            return
        session = self._claim
        if session is not None and session.id != response.session_id:
            session = None  # (another's: none can claim between Handshake's claim, after its awaits, and here)
        if session is not None:
            session.answering = True
        try:
            await context.write(response)
        except asyncio.CancelledError:  # (the call ended while its answer was on its way: deadline, cancel, reset)
            self._unanswered(response.session_id, context)
            raise
        except Exception:  # (gRPC could not send it: the call had ended already)
            self._unanswered(response.session_id, context)
            # Ended as gRPC ends a cancelled call (a debug line): a status sent now would fail alike,
            # and gRPC would log its traceback, which says nothing of what happened.
            raise asyncio.CancelledError from None
        finally:
            if session is not None:
                session.answering = False
                session.last_seen = time.monotonic()  # (its silence counts from when the answer left)
        if _deadline_passed(context):
            # Sent, but too late: a client takes a unary answer only with the status that follows it,
            # and the call's deadline, which has passed here, passed on the client first (the server's
            # counts from the request's arrival, the client's from its sending).
            self._unanswered(response.session_id, context, sent=True)
            raise asyncio.CancelledError

    def _unanswered(self, session_id: str, context: grpc.aio.ServicerContext, *, sent: bool = False) -> None:
        """Give up the claim of ``session_id``, whose Handshake answer could not be sent (``sent``: was
        sent after the call's deadline), unless a call has used that session meanwhile (its client got
        the session id after all) or it ended."""
        claim = self._claim
        if claim is None or claim.id != session_id or claim.used:
            return
        if sent:
            why = "it was sent after the call's deadline had passed"
        elif _deadline_passed(context):
            why = "the call's deadline passed before it could be sent"
        else:
            limit = _receive_limit_hint(claim.answer_bytes)
            why = "the call ended while it was being sent (the client cancelled it, its connection closed" + (
                f", or it refused an answer that large: {limit})" if limit else ")"
            )
        self._end(
            claim,
            f"its Handshake answer ({claim.answer_bytes:,} bytes) did not reach the client: {why}; "
            "the envs are free again",
            "unanswered",
            level=logging.WARNING,
        )

    def _unused_note(self, owner: Session, now: float) -> str:
        """What a refused Handshake adds about a claim no call has used: its client may never have got
        the answer (deadline, too small a receive limit), which the server could not tell."""
        if owner.used:
            return ""
        if owner.answering:
            return (
                f". Its Handshake's answer ({owner.answer_bytes:,} bytes) is still being sent: if its client has "
                "given that call up (its deadline passed, or it refused an answer that large), the claim ends as "
                "soon as the server notices; try again in a moment"
            )
        left = max(0.0, self._config.claim_timeout_s - (now - owner.last_seen))
        limit = _receive_limit_hint(owner.answer_bytes)
        return (
            f". No call has used that session yet: if that learner is you, your client did not get the "
            f"Handshake's answer, which takes {owner.answer_bytes:,} bytes ({limit + '; ' if limit else ''}did its "
            f"deadline pass, or did it give the call up?); the claim ends in {left:.0f} s"
        )

    def _note_unchecked_token(self, session: Session) -> None:
        """Log (rate-limited) that ``session``'s learner sent a token, which this server does not
        check: its user may believe the server protected (the learner warns too). A warning only where
        anyone who reaches the server may use it: one that requires client certificates admits only
        their holders, and the token is then a second secret it was not asked to keep (a note)."""
        suffix = self._unchecked_tokens.note("Handshake", grpc.StatusCode.OK)
        if suffix is None:
            return
        if self._config.tls_client_ca is not None:
            log.info(
                "%s sent an auth token, which this server does not check (started without --auth-token); it "
                "admits only clients with a certificate its --tls-client-ca signed %s",
                session.describe(),
                suffix,
            )
            return
        log.warning(
            "%s sent an auth token, but this server checks none (started without --auth-token): anyone "
            "who can reach it may use it; start it with --auth-token or ENVFLEET_AUTH_TOKEN %s",
            session.describe(),
            suffix,
        )

    async def Hold(self, request: pb.HoldRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.HoldEvent]:
        try:
            session = self._session(request.session_id)
        except Exception as err:
            self.end_call(context, err, "Hold", request)
            return
        session.holds += 1
        try:
            await session.ended.wait()
        finally:
            session.holds -= 1
            if session.holds == 0 and not session.ended.is_set():
                # The learner cancelled the stream, closed, crashed, or its connection died.
                session.last_seen = time.monotonic()
                self._end(session, "its Hold stream ended (learner closed or disconnected)", "hold_ended")
        yield pb.HoldEvent(reason=session.end_reason)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        claim = self._claim
        if claim is not None and _same_id(claim.id, request.session_id):
            self._end(claim, "released", "released")
        return pb.ReleaseResponse()

    @_rpc
    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetResponse:
        start = time.perf_counter()
        session = self._session(request.session_id)
        k = self._num_envs
        seeds: list[int | None] | None = None
        if request.seeds:
            if len(request.seeds) != k:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"seeds: expected {k} (one per env) or none, got {len(request.seeds)}",
                )
            seeds = [s.value if s.HasField("value") else None for s in request.seeds]
        seed: list[int | None] | int | None = seeds
        if seeds is not None and self._config.vectorization == "vector_entry_point":
            seed = seeds[0]  # an env's own vectorized implementation takes one seed for all its envs
        options: dict[Any, Any] | None = None  # (str keys, and NO_OPTIONS_KEY)
        if request.HasField("options"):
            # (writeable copies: an env may change an option's array in place, as it may locally)
            decoded = codec.decode_value(request.options, "options", writeable=True)
            if decoded is not None and not isinstance(decoded, dict):
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"options: expected a map or nothing, got {type(decoded).__name__}",
                )
            options = decoded
            if options is not None and "reset_mask" in options:
                # gymnasium's vector envs read options["reset_mask"] themselves; it must come checked.
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "options: the key 'reset_mask' is reserved; select envs with the request's reset_mask field",
                )
        mask: np.ndarray | None = None  # the envs to reset; None: all
        if request.reset_mask:
            if len(request.reset_mask) != k:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"reset_mask: expected {k} bools or none, got {len(request.reset_mask)}",
                )
            if not any(request.reset_mask):
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "reset_mask: at least one env must be selected")
            if self._config.vectorization == "vector_entry_point" and not all(request.reset_mask):
                # (gymnasium's vector envs read the mask; an env's own vectorized implementation may not,
                # and reset every env: gymnasium's CartPole one does, silently)
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "reset_mask: this server steps the env's own vectorized implementation (--vectorization "
                    "vector_entry_point), which may reset all its envs when asked to reset some (gymnasium's "
                    "CartPole one does); reset all of them, or serve the env with --vectorization sync or async",
                )
            if self._needs_reset:
                why = "" if self._reset_why == _RESET_FIRST else f" ({self._reset_why})"
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"reset_mask: reset every env once before resetting some{why}"
                )
            mask = np.array(request.reset_mask, dtype=np.bool_)
            if options is None and self._config.vectorization != "vector_entry_point":
                # No options in the request: the envs get None (their IsolateErrors takes this key out),
                # not the {} that gymnasium's vector envs leave once they took reset_mask out.
                options = {NO_OPTIONS_KEY: True}
            options = {**(options or {}), "reset_mask": mask}
        result, _ = await self._run_env(session, "reset", self.env.reset, seed=seed, options=options)
        try:
            obs, infos = result
            response = _encode_reset(obs, infos, self._unsendable_infos)
            self._check_answer_bytes(response, "Reset")
        except Exception as err:
            self._unsent(session, "Reset", err)  # (the envs were reset, and their client will not see it)
            raise
        # Only once its answer is built, and only for the session that asked: one that ended while its
        # reset ran (its learner went away) must not stand in for the reset the next session's Handshake
        # asked for.
        if self._claim is session:
            self._needs_reset = False
            if self._config.autoreset_mode == gym.vector.AutoresetMode.DISABLED.value:
                # (the mask as sent, not options["reset_mask"]: gymnasium's Sync/AsyncVectorEnv pop it from
                # the options they are given, which left None here and every ended env forgotten)
                self._ended = (
                    np.zeros(k, dtype=np.bool_) if mask is None or self._ended is None else self._ended & ~mask
                )
        if self._metrics is not None:
            self._metrics.observe_reset(time.perf_counter() - start)
        if _deadline_passed(context) or context.cancelled():
            # A reset the loop waited for (quick ones: not cancellable) past its caller's deadline: the
            # answer goes nowhere, as a cancelled one's on the env thread (see _run_env).
            self._answer_lost(request.session_id, "Reset")
        return response

    @_rpc
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        response = await self.step(request)
        if _deadline_passed(context) or context.cancelled():
            # A step the loop waited for (quick ones: not cancellable) past its caller's deadline: the
            # answer goes nowhere, as a cancelled one's on the env thread (see _run_env).
            self._answer_lost(request.session_id)
        return response

    async def StepStream(
        self, request_iterator: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # One response per request, in order, until the client half-closes; an error ends the stream
        # with the status Step would have returned.
        task = asyncio.current_task()
        assert task is not None
        while True:
            # While it waits for a request, the stream is idle: a shutdown ends it (a stream that is
            # stepping finishes its step first), not at once but after a short linger, so that a
            # request the learner is sending meanwhile is answered UNAVAILABLE "shutting down" (a
            # stream the server ends while the learner writes to it fails there with a status of
            # gRPC's own, INTERNAL "Internal error from Core", that says nothing of the shutdown).
            self._idle_streams.add(task)
            try:
                if self.draining:
                    request = await asyncio.wait_for(context.read(), self._drain_linger_s)
                else:
                    request = await context.read()
            except (asyncio.CancelledError, TimeoutError):
                if not self.draining:
                    raise
                self.end_call(context, shutting_down(), "StepStream")
                return
            finally:
                self._idle_streams.discard(task)
            if request is grpc.aio.EOF:
                return
            try:
                if isinstance(request, MalformedRequest):
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                response = await self.step(request)  # (UNAVAILABLE "shutting down" once draining)
            except Exception as err:
                self.end_call(context, err, "StepStream", request)
                return
            try:
                await context.write(response)
            except BaseException:  # (the stream ended under the step: cancelled, its deadline passed)
                self._answer_lost(request.session_id)
                raise

    def drain(self) -> None:
        """Start shutting down: refuse new sessions and steps, end the session, and end idle step
        streams after a short linger (see StepStream).

        Calls in flight (a step being computed) finish; the server's ``stop(grace)`` waits for them.
        """
        self.draining = True
        self.end_all(SHUTDOWN_REASON)
        asyncio.get_running_loop().call_later(self._drain_linger_s, self._end_idle_streams)

    def _end_idle_streams(self) -> None:
        for task in list(self._idle_streams):
            task.cancel()

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        """Step the session's envs with the request's actions (Step, StepStream and the step socket)."""
        start = time.perf_counter()
        session, actions = self._step_actions(request)
        result, env_seconds = await self._run_env(session, "step", self.env.step, actions)
        return self._step_response(session, result, env_seconds, start, request.step_id)

    def step_now(self, request: pb.StepRequest) -> pb.StepResponse | None:
        """:meth:`step` without waiting, when it needs no wait: the envs are free and their steps
        quick enough for the loop to wait for (see INLINE_LIMIT_S); None otherwise (await :meth:`step`)."""
        if self._env_lock.locked() or not self._quick("step"):
            return None
        start = time.perf_counter()
        session, actions = self._step_actions(request)
        result, env_seconds = self._quick_call(session, "step", self.env.step, actions)
        return self._step_response(session, result, env_seconds, start, request.step_id)

    def _quick_call(
        self, session: Session, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[Any, float]:
        """A quick env call, the loop waiting for it: on the env thread for envs bound to one thread (see
        :func:`one_thread`), else on the loop itself (a thread hand-over each way cost 2x4 CartPole ~30 % of its
        steps/s on 2 cores)."""
        if self._one_thread:
            return self._env_thread.call(self._call_env, session, kind, fn, *args, **kwargs)
        return self._call_env(session, kind, fn, *args, **kwargs)

    def _step_actions(self, request: pb.StepRequest) -> tuple[Session, Any]:
        """The request's session and its actions, checked; ServiceError for a request that cannot step."""
        session = self._session(request.session_id)
        if self._needs_reset:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, self._reset_why)
        self._check_ended()
        # (writeable copies: an env may clip its action in place, as it may under gymnasium's vector envs)
        actions = codec.decode_value(request.actions, "actions", writeable=True)
        try:
            return session, check_actions(self._act_space, actions, self._num_envs)
        except InvalidActionError as err:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(err), err.env_index) from err

    def _check_ended(self) -> None:
        """FAILED_PRECONDITION (a ServiceError) under autoreset Disabled while an env that ended waits for
        its reset: refused here, before gymnasium's assertion (INTERNAL, blamed on the env)."""
        if self._ended is not None and self._ended.any():
            ended = np.flatnonzero(self._ended)
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"autoreset is Disabled on this server and env{'s' if len(ended) > 1 else ''} "
                f"{', '.join(map(str, ended))} of it ended at the last step: reset {'them' if len(ended) > 1 else 'it'} "
                "first (a Reset whose ResetRequest.reset_mask selects those envs, which the Python learner sends for "
                "reset(options={'reset_mask': mask}), or a full reset); nothing was stepped",
                int(ended[0]),
            )

    def _step_response(
        self, session: Session, result: Any, env_seconds: float, start: float, step_id: int
    ) -> pb.StepResponse:
        """The answer to a step of ``session`` that gave ``result``."""
        try:
            return self._build_step_response(session, result, env_seconds, start, step_id)
        except Exception as err:
            self._unsent(session, "Step", err)  # (the envs stepped, and their client will not see it)
            raise

    def _build_step_response(
        self, session: Session, result: Any, env_seconds: float, start: float, step_id: int
    ) -> pb.StepResponse:
        obs, rewards, terminations, truncations, infos = result
        self.steps += 1
        response = pb.StepResponse(env_seconds=env_seconds, step_id=step_id)
        _encode_outputs(obs, response.observations, "observations")
        try:
            codec.encode_tensor(np.asarray(rewards, dtype=np.float64), response.rewards, "rewards")
            codec.encode_tensor(np.asarray(terminations, dtype=np.bool_), response.terminations, "terminations")
            codec.encode_tensor(np.asarray(truncations, dtype=np.bool_), response.truncations, "truncations")
        except (TypeError, ValueError) as err:
            raise ServiceError(
                grpc.StatusCode.INTERNAL, f"the env returned rewards or flags that are not numbers: {err}"
            ) from err
        if self._ended is not None and self._claim is session:
            # (a step of a session that ended meanwhile leaves the next session's bookkeeping alone)
            self._ended = np.logical_or(terminations, truncations)
        _encode_infos(infos, response.infos, self._unsendable_infos)
        self._check_answer_bytes(response, "Step")
        if self._metrics is not None:
            self._metrics.observe_step(time.perf_counter() - start, env_seconds, self._num_envs)
            errors = infos.get("_" + ENV_ERROR_KEY)
            if errors is not None:
                self._metrics.env_errors.inc(int(np.count_nonzero(errors)))
        return response

    def _check_answer_bytes(self, response: pb.StepResponse | pb.ResetResponse, method: str) -> None:
        """INTERNAL (an _AnswerTooLarge) for an answer larger than a message may be, which gRPC would fail
        with an error of its own (RESOURCE_EXHAUSTED "Sent message larger than max", a traceback in the
        log; on the step socket, a frame the learner refuses), naming neither the env nor its infos.

        The observations fit (the server checked at start that they leave ANSWER_HEADROOM free): the
        infos alone can make an answer too large. Only an answer whose observations and infos come
        within the headroom of the limit is measured whole, ``ByteSize()`` encoding it once more
        (~1 ms per 20 MB): the others, most of them, cost the infos' size alone."""
        info_bytes = response.infos.ByteSize()
        if self._observation_bytes + info_bytes <= MAX_MESSAGE_BYTES - ANSWER_HEADROOM:
            return
        size = response.ByteSize()
        if size <= MAX_MESSAGE_BYTES:
            return
        # (the envs stepped, or reset, and their client will not see it: the caller asks for a reset, see _unsent)
        # (after a Step, a reset lets the session go on; after a Reset, another gives the same infos again)
        advice = (
            "reset before stepping again, and have the env put less in its infos"
            if method == "Step"
            else "have the env put less in the infos its reset returns (resetting again gives them again)"
        )
        message = (
            f"the {method} answer would take {size:,} bytes, over the {MAX_MESSAGE_BYTES:,} bytes (64 MiB) a message may "
            f"take: its infos take {info_bytes:,}; {advice} (a large array: send it in parts, or on request)"
        )
        log.warning("%s", message)
        raise _AnswerTooLarge(grpc.StatusCode.INTERNAL, message)

    def _unsent(self, session: Session, method: str, err: Exception) -> None:
        """The envs stepped (``method`` "Step") or reset for ``session``, and its answer could not be built
        (``err``): its client will not see where they are, so a full reset first, unless the session
        ended meanwhile (its successor's Handshake asked for one, and is not told of another's call)."""
        if self._claim is not session:
            return
        if method == "Step":
            self._require_reset(
                _step_unseen("answer was too large to send" if isinstance(err, _AnswerTooLarge) else _UNBUILT)
            )
        elif isinstance(err, _AnswerTooLarge):
            self._require_reset(
                "the last Reset's answer was too large to send: reset the envs again, with an env that puts "
                "less in its infos"
            )
        else:
            self._require_reset(_reset_unseen(_UNBUILT))

    async def _run_env(
        self, session: Session, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[Any, float]:
        """``fn(*args, **kwargs)``, a ``kind`` call of ``session``, and the seconds it took; a ServiceError
        (INTERNAL) if the env raised, (FAILED_PRECONDITION) if the session ended while the call waited.

        Envs wrapped in IsolateErrors (all but ``vector_entry_point`` ones) report their own
        exceptions per env; what reaches here failed the whole vector env.
        """
        # (counted from before the wait for the envs: a call queued behind a slow one is no silence either)
        session.calls += 1
        try:
            async with self._env_lock:
                if self._quick(kind):  # (the loop waits for it: no round trip through the loop)
                    return self._quick_call(session, kind, fn, *args, **kwargs)
                loop = asyncio.get_running_loop()
                call = functools.partial(self._call_env, session, kind, fn, *args, **kwargs)
                future = loop.run_in_executor(self._env_thread, call)
                try:
                    return await asyncio.shield(future)
                except asyncio.CancelledError:
                    # The envs step (or reset), and no one will see it: whatever ends there (an episode
                    # under next-step or same-step autoreset, an env that then waits for its reset under
                    # Disabled) its client never learns. A full reset first, whatever the autoreset
                    # mode: bookkeeping taken from the thrown-away result (_ended) would keep
                    # Disabled's envs right, but not an episode the other modes end, and restart,
                    # unseen. Said now, so that a step the client sends meanwhile is refused too.
                    # Only to the session that asked: one that ended meanwhile leaves its successor
                    # alone (whose Handshake asked for a reset anyway, and must not hear of this call).
                    if self._claim is session:
                        self._require_reset(_step_unseen(_GAVE_UP) if kind == "step" else _reset_unseen(_GAVE_UP))
                    # The call was cancelled (its learner went away or gave up), but the env goes on in
                    # its thread: keep the lock until it is done, so that no other call (the learner's
                    # next Reset, say) touches the env meanwhile.
                    await _wait_uncancellable(future)
                    raise
        finally:
            session.calls -= 1
            session.last_seen = time.monotonic()  # (its silence counts from the call's end)

    def _answer_lost(self, session_id: str, method: str = "Step") -> None:
        """The answer to a step (or, ``method`` "Reset", a reset) of ``session_id`` will not reach its
        client: the envs moved on unseen, so a full reset first (unless the session ended meanwhile: its
        successor resets anyway)."""
        claim = self._claim
        if claim is not None and _same_id(claim.id, session_id):
            self._require_reset(_step_unseen(_GAVE_UP) if method == "Step" else _reset_unseen(_GAVE_UP))

    def _require_reset(self, why: str = "") -> None:
        """Refuse steps until the next full reset, saying ``why`` (by default, that the envs need one)."""
        self._needs_reset = True
        self._reset_why = why or _RESET_FIRST

    def _quick(self, kind: str) -> bool:
        """Whether ``kind`` calls (step, reset) have been quick enough for the loop to wait for: on average, and
        none slow for a while (see _REMEMBERED_CALL_S); not before the first."""
        if self._env_seconds.get(kind, math.inf) >= INLINE_LIMIT_S:
            return False
        slow_at = self._slow_at.get(kind)
        return slow_at is None or time.monotonic() - slow_at > _REMEMBER_S

    def _call_env(
        self, session: Session, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[Any, float]:
        """``fn(*args, **kwargs)``, a ``kind`` call of ``session``, here and now (the caller holds the
        envs; on the env thread), timed; see :meth:`_run_env`.

        What the call was checked for before it waited for the envs is checked again: a call waits
        behind others (a slow step, say), which may have changed what it may do."""
        if self._dead is not None:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"{self._dead}; the server cannot step or reset: restart it")
        if self._claim is not session:
            # Its session ended while it waited (released, timed out, its Hold stream gone): the envs
            # are no longer its learner's, but maybe another's already, whose envs it must not reset
            # (with its seeds and options) or step; the caller is told, not answered as if it ran.
            done = "reset" if kind == "reset" else "stepped"
            ended = f": {session.end_reason}" if session.end_reason else ""
            raise _not_owned(
                session.id, f"it ended while this {kind} waited for the envs{ended}", tail=f"; nothing was {done}"
            )
        if kind == "step":
            if self._needs_reset:
                # (a step that waited for the envs behind one whose answer was thrown away, see _run_env)
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, self._reset_why)
            # (autoreset Disabled: behind a step of the same session that ended an env; gymnasium's
            # assertion would blame the env, and cost the session a full reset)
            self._check_ended()
        begun, start = self._call_begins(kind)
        self._envs_ran = True  # (not fresh any more: see _fresh_envs)
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:
            # Whatever the env raised, on the env thread (where no cancellation of the caller's own
            # arrives: an asyncio.CancelledError, a GeneratorExit or a BaseException of the env's is
            # the env's error, as an Exception is). The env's state is unknown after it raised: the
            # learner must reset before stepping (told why: it did reset, maybe, before this call). Not a
            # session that ended meanwhile: its successor's Handshake asked for a reset anyway, and must
            # not hear of this call.
            if self._claim is session:
                self._require_reset(
                    f"the env raised in the last {kind} ({type(err).__name__}), so the envs' state is unknown: "
                    "reset them first (a full reset); nothing was stepped"
                )
            # (an observation that does not fit the space names its env: the status does too; the env
            # returned it, raising nothing; learner.faults.misfit_reported looks for ": ObservationLayoutError: ")
            misfit = isinstance(err, ObservationLayoutError)
            did = f"returned in {kind} what does not fit" if misfit else f"raised in {kind}"
            what = f"the env {did}: {type(err).__name__}: {err}"
            env_index = err.env_index if isinstance(err, ObservationLayoutError) else None
            if _workers_ended(self.env):
                # (gymnasium's AsyncVectorEnv shuts a worker down when an exception escapes its env;
                # IsolateErrors catches the env's own, so this takes a failure of the env's layout.)
                self._dead = f"the async vector env's worker processes ended when {what}"
                if self.on_dead is not None:
                    self.on_dead()
                log.error("%s; the server cannot step or reset any more: restart it", self._dead)
                raise ServiceError(
                    grpc.StatusCode.INTERNAL, f"{what}; its worker processes ended: restart the server", env_index
                ) from err
            log.warning(
                "env %s %s: %s: %s", kind, "returned what does not fit" if misfit else "raised", type(err).__name__, err
            )
            raise ServiceError(grpc.StatusCode.INTERNAL, f"{what}; reset before stepping again", env_index) from err
        finally:
            elapsed = self._call_ends(kind, begun, start)
            before = self._env_seconds.get(kind)
            self._env_seconds[kind] = elapsed if before is None else before + _EWMA_WEIGHT * (elapsed - before)
            if elapsed >= _REMEMBERED_CALL_S:
                self._slow_at[kind] = time.monotonic()
        return result, elapsed

    def usual_seconds(self, kind: str) -> float:
        """How long ``kind`` calls (step, reset) have taken lately (a moving average); 0 before the first."""
        return self._env_seconds.get(kind, 0.0)

    async def run_in_env_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the env thread, which runs every env call (building the envs, closing them)."""
        return await asyncio.get_running_loop().run_in_executor(self._env_thread, functools.partial(fn, *args))

    def call_in_env_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the env thread, waited for (the loop with it: no env call may run meanwhile)."""
        return self._env_thread.call(fn, *args)

    async def idle(self, timeout: float) -> bool:
        """Whether the envs are free within ``timeout`` seconds (at once, if ``timeout`` <= 0): no env call
        runs on the env thread. An env call holds the lock until its thread is done with the envs, even
        once its gRPC call has been cancelled (see :meth:`_run_env`)."""
        try:
            async with asyncio.timeout(max(timeout, 0.0)), self._env_lock:
                return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self._env_thread.shutdown(wait=False, cancel_futures=True)

    def detach(self) -> None:
        """Let go of the vector env (the server calls it once the envs are closed): whatever still
        holds this service (the server's watchdog thread, for one, which runs until the process
        exits) no longer keeps the envs alive until the interpreter's shutdown, where a simulator's
        bindings would then report them leaked (ale-py's nanobind: "nanobind: leaked 1 instances!")."""
        self._env = None


HANDSHAKE_METHOD = f"/{SERVICE_NAME}/Handshake"


class AnswerHandshakes(grpc.aio.ServerInterceptor):
    """Serves Handshake with ``service.answer_handshake``, a handler that sends its answer itself.

    That handler streams its answer, one message, which is a unary answer on the wire (a message,
    then the status; a refusal: gRPC's Trailers-Only form, which gRPC clients read alike). The
    generated code registers Handshake as unary, whose answer gRPC sends after the handler has
    returned, telling it nothing of a failure (see EnvService.answer_handshake). The last
    interceptor: the others see the handler it gives.
    """

    def __init__(self, service: EnvService) -> None:
        self._service = service

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != HANDSHAKE_METHOD:
            return handler
        return grpc.unary_stream_rpc_method_handler(
            self._service.answer_handshake,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# Simulators whose version may change an env's dynamics: EnvSpec.versions names them when loaded.
SIMULATORS = ("mujoco", "ale_py", "Box2D", "pybullet", "dm_control")  # (module names, as imported)


def _versions() -> dict[str, str]:
    """What this server runs (EnvSpec.versions), once its envs are built (and their simulators loaded);
    run from a git checkout, its commit too (``envfleet_commit``: the version is the same at every commit)."""
    return runtime_versions("gymnasium", "numpy", *SIMULATORS)


def space_bytes(space: gym.Space[Any]) -> int:
    """Bytes one observation of ``space`` takes on the wire (its arrays' data; Dict and Tuple: their parts')."""
    if isinstance(space, gym.spaces.Dict):
        return sum(space_bytes(s) for s in space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return sum(space_bytes(s) for s in space.spaces)
    shape, dtype = space.shape or (), space.dtype
    return math.prod(shape) * (dtype.itemsize if dtype is not None else 8)


def _full_bounds_bytes(space: gym.Space[Any], *, masks: bool = False) -> int:
    """Bytes the Box bounds of ``space`` take at full shape (low and high; Dict and Tuple: their parts'): the
    least its spec takes with them so; with ``masks``, every Box field at full shape, an integer Box's unbounded
    masks too (one byte an element, where sent, as codec.encode_space sends them: see _full_spec_most)."""
    if isinstance(space, gym.spaces.Dict):
        return sum(_full_bounds_bytes(s, masks=masks) for s in space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return sum(_full_bounds_bytes(s, masks=masks) for s in space.spaces)
    if not isinstance(space, gym.spaces.Box):
        return 0
    sent = 0
    if masks and space.dtype.kind != "f":
        sent = sum(
            math.prod(space.shape) for bounded in (space.bounded_below, space.bounded_above) if not bounded.all()
        )
    return 2 * space_bytes(space) + sent


def _full_spec_most(obs_space: gym.Space[Any], act_space: gym.Space[Any], spec: pb.EnvSpec) -> int:
    """The most the spec ``spec`` (compact) describes takes with its Box bounds at full shape, from the spaces'
    sizes, without encoding them: every Box field at full shape (low and high in the Box's dtype; an integer Box's
    unbounded masks, one byte an element, where sent), plus the compact spec, plus 9 bytes for each message's
    length prefix grown as its content grows (a varint takes 10 bytes at most; a spec holds fewer messages than
    half its bytes, each a tag and a length at least)."""
    fields = _full_bounds_bytes(obs_space, masks=True) + _full_bounds_bytes(act_space, masks=True)
    return fields + spec.ByteSize() + 9 * (spec.ByteSize() // 2)


def _workers_ended(env: gym.vector.VectorEnv) -> bool:
    """Whether ``env`` is an AsyncVectorEnv with a worker gymnasium has shut down (after its error)."""
    pipes = getattr(env.unwrapped, "parent_pipes", None)
    return isinstance(env.unwrapped, gym.vector.AsyncVectorEnv) and pipes is not None and any(p is None for p in pipes)


def _same_envs(spec: pb.EnvSpec | None, other: pb.EnvSpec) -> bool:
    """Whether ``spec`` describes the envs ``other`` does, the versions it names aside (a simulator an env
    imports at its first reset is named by a spec made after it)."""
    if spec is None:
        return False
    mine, theirs = pb.EnvSpec(), pb.EnvSpec()
    mine.CopyFrom(spec)
    theirs.CopyFrom(other)
    mine.ClearField("versions")
    theirs.ClearField("versions")
    return mine == theirs


def _carries_token(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call carries ``authorization`` metadata (a token, whatever it is)."""
    return any(key == AUTH_METADATA_KEY for key, _ in context.invocation_metadata() or ())


# gRPC's default max receive message length (clients' too, unless they set theirs): a Handshake answer
# over it may have been refused for its size.
_GRPC_DEFAULT_RECEIVE = 4 * 1024 * 1024


def _receive_limit_hint(answer_bytes: int) -> str:
    """The question to ask of a client that may have refused an answer of ``answer_bytes`` for its
    size ("" for answers under gRPC's default limit, which no client sets lower in practice)."""
    if answer_bytes <= _GRPC_DEFAULT_RECEIVE:
        return ""
    return "is its max receive message length at least that? gRPC's default is 4 MiB"


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call of ``context`` has a deadline, and it has passed."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def _same_id(session_id: str, given: str) -> bool:
    """Whether ``given`` is ``session_id``, compared in constant time (any text, not only ASCII)."""
    return bool(given) and secrets.compare_digest(session_id.encode(), given.encode("utf-8", "replace"))


def _not_owned(session_id: str, why: str, *, tail: str = "") -> ServiceError:
    """FAILED_PRECONDITION for a call of session ``session_id``, which does not own the server (``why``);
    ``tail`` says what the call left undone. Learners look for NOT_OWNED in the text (a session gone)."""
    return ServiceError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"session {session_id[:8]!r} {NOT_OWNED} ({why}){tail}; call Handshake again",
    )


def shutting_down() -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)


async def _wait_uncancellable(future: asyncio.Future[Any]) -> bool:
    """Wait until ``future`` is done, whatever cancellations arrive meanwhile (its outcome, an error too, is the
    caller's to read); whether one did."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # (the future's own outcome)
            pass
    return cancelled


def _encode_reset(obs: Any, infos: dict[str, Any], unsendable: codec.Unsendable) -> pb.ResetResponse:
    response = pb.ResetResponse()
    _encode_outputs(obs, response.observations, "observations")
    _encode_infos(infos, response.infos, unsendable)
    return response


def _encode_outputs(outputs: Any, out: pb.Value, where: str) -> None:
    """Encode what the env returned; a value the wire cannot carry is the env's fault (INTERNAL)."""
    try:
        codec.encode_value(outputs, out, where)
    except codec.CodecError as err:
        raise ServiceError(grpc.StatusCode.INTERNAL, f"the env returned {where} that cannot be sent: {err}") from err


def _encode_infos(infos: dict[str, Any], out: pb.Value, unsendable: codec.Unsendable) -> None:
    """Encode a step's or reset's vector infos; a value no wire form carries goes as ``unsendable``
    says (see UnsendableInfos), one too large fails the call (INTERNAL)."""
    if type(infos) is dict and not infos:  # (most steps: the empty map encode_value writes, at a fraction of its cost)
        out.map.SetInParent()
        return
    try:
        codec.encode_value(infos, out, "infos", unsendable=unsendable)
    except codec.CodecError as err:
        raise ServiceError(
            grpc.StatusCode.INTERNAL,
            f"the env returned an info value that cannot be sent: {err}",
        ) from err


# An info value's repr is cut to this many characters (a large set's would swell every response).
_MAX_REPR = 10_000
# Where in the infos a value is per env (an object array's item, a list's or a tuple's), not a key's
# array over envs or a dict of them: an index in its path, "infos['k'][3]".
_INDEX = re.compile(r"\[\d+\]")


class UnsendableInfos:
    """What the server sends for an info value that no wire form carries (an arbitrary object, a set,
    a dict with keys that are not str, a complex number, ...), so that the step is not lost: envfleet
    never pickles (a learner must not unpickle what a server sends). An env's own value (an item of
    the object array gymnasium keeps the key's values in) goes as its ``repr()``, a str; a dict that
    gymnasium's vector env spread over the envs (an env's info ``{"d": {1: "a"}}`` is the vector info
    ``{"d": {1: array, "_1": mask}}``) goes with its keys as ``str(key)``, so that it is still a dict of
    arrays over envs (``infos["d"]["1"]`` and the ``"_1"`` mask gymnasium already names so), which
    the learner joins across servers; an array over envs of a dtype with no wire form goes as a str
    array of its items' reprs. Each info key is warned of once, in the server's log.
    """

    def __init__(self) -> None:
        self.warned: set[str] = set()
        """The info keys warned of (their paths without indices: "['obj']", "['final_info']['obj']")."""

    def __call__(self, value: Any, where: str, reason: str) -> Any:
        per_env = _INDEX.search(where) is not None
        path = _INDEX.sub("", where.removeprefix("infos"))
        what = f"a {type(value).__module__}.{type(value).__qualname__}"
        keys = [_key_text(k) for k in value] if isinstance(value, dict) and not per_env else []
        if isinstance(value, dict) and not per_env and len(set(keys)) == len(value):
            sent: Any = dict(zip(keys, value.values(), strict=True))
            done = "sent with its keys as str"
        elif isinstance(value, np.ndarray) and not per_env:
            sent = np.array([_repr(item) for item in value.flat], dtype=str).reshape(value.shape)
            what = f"an array of dtype {value.dtype}"
            done = "sent as a str array of its items' reprs"
        else:
            sent = _repr(value)
            done = "sent as its repr"
        if path not in self.warned:
            self.warned.add(path)
            name = path[1:-1] if path.count("[") == 1 and path.endswith("]") else path  # ('obj', or a path)
            log.warning(
                "info key %s: %s cannot cross the wire (no pickle); %s; %s (at %s); its later values go the same "
                "way, unwarned: to get the value itself, make the env put a type that can be sent there",
                name,
                what,
                done,
                reason,
                where,
            )
        return sent


def _key_text(key: Any) -> str:
    """A dict key as a str that can be sent: ``str(key)``, a lone surrogate in it backslash-escaped."""
    return escape_surrogates(key if isinstance(key, str) else str(key))


def _repr(value: Any) -> str:
    """``repr(value)``, cut to _MAX_REPR characters; a fixed text where repr itself raises."""
    try:
        text = repr(value)
    except Exception as err:  # (an env's own class: its __repr__ may fail)
        text = f"<{type(value).__module__}.{type(value).__qualname__} object; its repr raised {type(err).__name__}>"
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."
