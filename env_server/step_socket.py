"""The step socket: StepStream's twin on a plain Unix socket, for learners on the server's host.

Same messages, checks and errors as StepStream, framed as the proto's header describes, without
HTTP/2: a gRPC message in Python costs several thread switches on each side, a frame here none. A
quick step (see ``service.INLINE_LIMIT_S``) is done inside ``data_received`` (on the env thread, the
callback waiting for it), the answer written before the callback returns; a slow one runs as a task,
like any env call of the service.

With ``spin_wait_s`` (``env-server --spin-wait-ms``), a connection whose learner has been sending its
next step soon after each answer looks for that step awake for up to ``spin_wait_s`` after answering
(polling the socket, yielding the CPU between looks) before the loop sleeps: a learner on the same
host then finds the server running, and the step skips the wake-up of a sleeping process (on a
2-core VM: 2 servers x 4 CartPoles 19k -> 22k env-steps/s; see the README's performance section).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import stat
import struct
import time

import grpc

from env_server.config import DEFAULT_MAX_REQUEST_BYTES
from env_server.interceptors import RefusalLog
from env_server.protocol import FRAME_ERROR, FRAME_HEADER, FRAME_STEP, NOT_OWNED
from env_server.rpc import env_pb2 as pb
from env_server.service import EnvService, ServiceError, shutting_down

__all__ = ["MAX_CONNECTIONS", "StepSocketServer"]

log = logging.getLogger(__name__)

# Open connections at once: a learner needs one per session; more is a misbehaving peer. (Those of
# sessions that ended are closed, so a learner that stopped or hangs does not keep its place.)
MAX_CONNECTIONS = 8

# Frames larger than this are written as their header, then their payload as it is (see _Connection.send);
# smaller ones are joined first, a copy that costs less than a second write, and one wake-up of the learner.
_JOIN_BYTES = 64 * 1024


FileIdentity = tuple[int, int, int]


def file_identity(path: str) -> FileIdentity | None:
    """What tells the file at ``path`` from one made there later: device, inode and change time (an
    inode number alone does not: ext4 gives a removed socket's number to the next file made)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns


def _set_mode(path: str, mode: int) -> FileIdentity:
    """chmod the socket this process has just made at ``path``, never following a link: in a folder
    others can write to, the socket may be replaced meanwhile by a link to another file, whose
    permissions a plain chmod would change. OSError if ``path`` is no longer a socket of this user's;
    the socket's identity (see :func:`file_identity`) otherwise.

    On Linux, through an ``O_PATH | O_NOFOLLOW`` descriptor (which holds the file itself, a link
    included) and its ``/proc/self/fd`` entry (fchmod refuses such descriptors; see open(2), O_PATH).
    Elsewhere the file is looked at first, and changed without following a link where the system can
    (lchmod: macOS, the BSDs; a small window remains where it cannot)."""
    o_path = getattr(os, "O_PATH", None)
    fd = os.open(path, o_path | os.O_NOFOLLOW) if o_path is not None and os.path.isdir("/proc/self/fd") else None
    try:
        info = os.fstat(fd) if fd is not None else os.lstat(path)
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError(
                f"{path}: expected the socket this server has just made, found "
                f"{'a link' if stat.S_ISLNK(info.st_mode) else 'another file'} (replaced by another process?)"
            )
        if fd is not None:
            os.chmod(f"/proc/self/fd/{fd}", mode)
        else:
            os.chmod(path, mode, **({"follow_symlinks": False} if os.chmod in os.supports_follow_symlinks else {}))
        info = os.fstat(fd) if fd is not None else os.lstat(path)
    finally:
        if fd is not None:
            os.close(fd)
    return info.st_dev, info.st_ino, info.st_ctime_ns


def remove_own_file(path: str, made: FileIdentity | None) -> None:
    """Remove ``path`` if it is still the file this process made (``made``), not one another server
    has made there since (a server started at the same path while this one's teardown ran)."""
    if made is not None and file_identity(path) == made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def check_stale(path: str, option: str = "") -> None:
    """OSError saying why, unless the socket at ``path`` is stale (nothing listens there: a server that
    was killed left it), so that another server's socket is never replaced, its learners taken over (the
    gRPC socket's, by env_server.server, and the step socket's). ``option``: "--unix-socket PATH", for an
    error naming it and saying what to do (else the reason alone)."""
    said, remove, stop = (f"{option}: ", "; remove it or pick another path", "; stop it or pick another path")
    if not option:
        said = remove = stop = ""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # nothing listens there: stale
    except PermissionError:
        raise OSError(
            f"{said}a socket this user may not connect to (another user's?): cannot tell whether a server listens "
            f"there{remove}"
        ) from None
    except (BlockingIOError, TimeoutError):
        pass  # a server whose backlog is full: busy, not gone
    except OSError as err:
        raise OSError(f"{said}{err.strerror or err}") from None
    finally:
        probe.close()
    raise OSError(f"{said}another server is listening there{stop}")


class StepSocketServer:
    """Listens on ``path`` and serves the steps of ``service``'s session there.

    A connection serves one session: when the session ends (however it ends), the connections that
    stepped in it are told so and closed, as its StepStream would be ended."""

    def __init__(
        self,
        service: EnvService,
        path: str,
        spin_wait_s: float = 0.0,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.service = service
        self.path = path
        self.spin_wait_s = spin_wait_s
        self.max_request_bytes = max_request_bytes  # the longest frame read (and so held) per connection
        self.connections: list[_Connection] = []  # oldest first
        self._server: asyncio.Server | None = None
        self._made: FileIdentity | None = None  # the socket file this server made (close removes only that)
        # Log lines about connections closed to make room (anyone on the host can open many).
        self._evictions = RefusalLog(what="connections closed to make room")

    @property
    def made(self) -> FileIdentity | None:
        """The identity of the socket file this server made (see :func:`file_identity`); None until it listens."""
        return self._made

    async def start(self, mode_of: str) -> None:
        """Listen (OSError if that fails, or if another server listens at the path); the socket gets the
        permissions of the file ``mode_of`` (the gRPC socket), set without following links (OSError if
        another file takes the socket's place first: see :func:`_set_mode`)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                check_stale(self.path)
                os.unlink(self.path)  # left by a server that was killed (gRPC does the same for its own)
        grpc_socket = os.lstat(mode_of)  # (not through a link: one swapped in would lend its target's mode)
        if stat.S_ISLNK(grpc_socket.st_mode):
            raise OSError(f"{mode_of}: expected the gRPC socket, whose permissions the step socket takes; found a link")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=self.path)
        self._made = _set_mode(self.path, stat.S_IMODE(grpc_socket.st_mode))
        self.service.on_session_end = self.session_ended

    def session_ended(self, session_id: str, reason: str) -> None:
        """Close the connections that stepped in session ``session_id``, which ended (``reason``): its
        learner may have stopped or hung (its process, and so its connections, live on), and a
        connection that stays would count against MAX_CONNECTIONS for good. One with a step in
        progress is closed once that step is answered."""
        if self.service.draining:
            return  # (drain() tells each connection that the server is shutting down)
        ended = [c for c in self.connections if c.holds(session_id)]
        for connection in ended:
            connection.end_session(_session_ended(session_id, reason))
        if ended:
            log.info("step socket: closing %d connection(s) of session %s, which ended", len(ended), session_id[:8])

    def admit(self, connection: _Connection) -> bool:
        """Count a new connection in; at the limit, close those of sessions that are over (should any
        be left: session_ended closes them), else the oldest one that never stepped (anyone who can
        open the socket can open connections; only the session's holder can step), or refuse the new
        one (False) if every one has stepped in the live session."""
        if len(self.connections) >= MAX_CONNECTIONS:
            for stale in list(self.connections):  # (owns() may end a claim that timed out: its hook closes some)
                if stale.stepped_in and not self.service.owns(stale.stepped_in):
                    stale.end_session(_session_ended(stale.stepped_in, "it is over"))
        if len(self.connections) >= MAX_CONNECTIONS:
            # (not one whose first step is in progress: its learner, told RESOURCE_EXHAUSTED, would
            # send that step again over gRPC, and the envs would step twice)
            idle = next((c for c in self.connections if not c.stepped_in and c.task is None and not c.closed), None)
            if idle is None:
                return False
            suffix = self._evictions.note("step socket", grpc.StatusCode.RESOURCE_EXHAUSTED)
            if suffix is not None:
                log.warning(
                    "step socket: %d connections open; closing the oldest that never stepped %s",
                    MAX_CONNECTIONS,
                    suffix,
                )
            # (not a refusal of anything it asked: neither counted nor logged as one; RESOURCE_EXHAUSTED,
            # so that a learner whose first step arrives too late steps over gRPC instead)
            idle.close_with(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"step socket: closed to make room for a new connection ({MAX_CONNECTIONS} were open and this one "
                "had not stepped); step over gRPC, or connect again",
                None,
            )
        self.connections.append(connection)
        return True

    def drain(self) -> None:
        """Shutdown starts: no new connections (as gRPC takes none: a server started at the path meanwhile
        finds the socket stale, and replaces it, see start; on Python 3.13+ asyncio removes the socket's file
        here, its ``cleanup_socket``, checking it is still this server's); idle connections are told so and
        closed; busy ones after their step."""
        if self._server is not None:
            self._server.close()  # (stops listening; the connections stay)
        for connection in list(self.connections):
            connection.drain()

    async def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the steps in progress (slow envs) to be answered."""
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def close(self) -> None:
        if self.service.on_session_end == self.session_ended:
            self.service.on_session_end = None
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.abort()
        remove_own_file(self.path, self._made)


class _Connection(asyncio.Protocol):
    """One learner's connection: frames in, one answer each, in order; the first error ends it."""

    def __init__(self, owner: StepSocketServer) -> None:
        self.owner = owner
        self.service = owner.service
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None  # a slow step in progress
        self.paused = False  # the peer does not read its answers: stop serving until it does
        self.closed = False
        # The session a step went through in (the peer holds its id), or "" until one has; a step in
        # progress that has not been answered does not count.
        self.stepped_in = ""
        self.ending: ServiceError | None = None  # the session ended during a step: close once it is answered
        # The session of the last answer, while part of it may be unsent (until the next frame comes: the
        # learner sends it once it has the whole answer); "" otherwise. See answer.
        self.unsent_answer = ""
        self.answered_at = 0.0  # perf_counter() of the last answer, until the next frame's first bytes
        # How soon the learner's next frame came after an answer (a moving average, each sample capped
        # at twice the spin wait so that one pause, an update between rollouts say, counts little).
        self.recent_gap = 0.0
        self._poller: select.poll | None = None
        self._send_buffer_asked = 0  # the SO_SNDBUF this server asked for (see fit_send_buffer)
        self._last_payload = b""  # that of the last large frame written (see send)
        self.peer = "the step socket"  # who connected, for log lines (see connection_made)
        self.session_id = ""  # of the last request read

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = _describe_peer(transport)
        if not self.owner.admit(self):
            self.fail(_too_many())  # (logged, at most once per 10 s: see EnvService.status)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.note_gap()
        self.unsent_answer = ""
        self.buffer += data
        if len(self.buffer) > FRAME_HEADER.size + self.owner.max_request_bytes:  # (reading pauses while busy)
            self.fail(_too_large(f"{len(self.buffer)} bytes sent and unanswered", self.owner.max_request_bytes))
            return
        self.serve()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._last_payload = b""
        if exc is not None and self.unsent_answer:  # (a write failed: the rest of the answer went nowhere)
            self.service._answer_lost(self.unsent_answer)
        with contextlib.suppress(ValueError):
            self.owner.connections.remove(self)
        if self.task is not None:
            self.task.cancel()  # the env call itself finishes (see EnvService._run_env)

    def pause_writing(self) -> None:
        self.paused = True
        self.hold_input(True)

    def resume_writing(self) -> None:
        self.paused = False
        self.hold_input(False)
        self.serve()

    def hold_input(self, hold: bool) -> None:
        """Stop reading while nothing is answered (a step in progress, a peer that does not read),
        so that what piles up is what the socket holds, not the server's memory."""
        if self.transport is None or self.closed:
            return
        if hold:
            self.transport.pause_reading()
        elif self.task is None and not self.paused:
            self.transport.resume_reading()

    # -- serving -----------------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer the complete frames received, in order, unless a step is in progress."""
        try:
            while not (self.closed or self.paused or self.task is not None):
                request = self.next_request()
                if request is None:
                    self.linger()
                    return
                if self.service.draining:
                    raise shutting_down()
                response = self.service.step_now(request)
                if response is None:  # the envs are busy or slow: step on the loop's terms
                    self.task = asyncio.get_running_loop().create_task(self.step_later(request))
                    self.hold_input(True)
                    return
                self.answer(request.session_id, response)
                self.answered_at = time.perf_counter()
        except Exception as err:
            self.fail(err)

    def note_gap(self) -> None:
        """A frame's first bytes came: count how soon after the last answer (once per answer). While
        the server does not wait awake, the gap includes its own wake-up, so it shows the learner
        a little slower than it is."""
        if self.answered_at:
            gap = min(time.perf_counter() - self.answered_at, 2 * self.owner.spin_wait_s)
            self.recent_gap += 0.25 * (gap - self.recent_gap)
            self.answered_at = 0.0

    def linger(self) -> None:
        """Just answered a step inline, for a learner whose next frames have been coming within the
        spin wait: look for the next one awake for up to that long (then the loop takes it in
        without a wake-up). Not while part of the answer waits to be sent: only the loop sends it,
        and the learner cannot send its next step before it has the whole answer."""
        spin_wait_s = self.owner.spin_wait_s
        if not self.answered_at or spin_wait_s <= 0 or self.recent_gap >= spin_wait_s:
            return
        if self.transport is None or self.paused or self.transport.get_write_buffer_size() > 0:
            return
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.transport.get_extra_info("socket").fileno(), select.POLLIN)
        deadline = time.monotonic() + spin_wait_s
        while time.monotonic() < deadline:
            if self._poller.poll(0):
                return
            os.sched_yield()  # let a process with work on this CPU (the learner, another server) run

    def next_request(self) -> pb.StepRequest | None:
        """The next complete frame's request (removed from the buffer), or None until one is in."""
        if len(self.buffer) < FRAME_HEADER.size:
            return None
        length, kind = FRAME_HEADER.unpack_from(self.buffer)
        if length > self.owner.max_request_bytes:
            raise _too_large(f"a frame of {length} bytes", self.owner.max_request_bytes)
        end = FRAME_HEADER.size + length
        if len(self.buffer) < end:
            return None
        payload = bytes(self.buffer[FRAME_HEADER.size : end])
        del self.buffer[:end]
        if kind != FRAME_STEP:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step socket: expected a frame of kind {FRAME_STEP} (a StepRequest), got kind {kind}",
            )
        try:
            request = pb.StepRequest.FromString(payload)
        except Exception as err:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step socket: the frame is not a valid StepRequest ({type(err).__name__}: {err}); "
                "is the client built from envfleet.v1's proto?",
            ) from err
        self.session_id = request.session_id
        return request

    async def step_later(self, request: pb.StepRequest) -> None:
        try:
            response = await self.service.step(request)
        except Exception as err:
            self.task = None
            self.fail(err)
            return
        self.task = None
        if self.closed:  # (the connection ended while the step ran: its answer goes nowhere)
            self.service._answer_lost(request.session_id)
            return
        self.answer(request.session_id, response)
        if self.service.draining:
            self.fail(shutting_down())
            return
        if self.ending is not None:
            self.end_session(self.ending)
            return
        self.hold_input(False)
        self.serve()  # frames that came meanwhile

    def answer(self, session_id: str, response: pb.StepResponse) -> None:
        """Send ``response``, the answer to a step of session ``session_id``.

        One that does not reach the learner (its end is closed: the write fails, now or for the part
        left to send, see connection_lost) means what a StepStream answer that cannot be written means:
        the envs moved on unseen, so the session's steps are refused until a full reset (was: the
        answer dropped, and the next step taken from where the learner never saw the envs). A learner
        that left during a slow step is seen only here: reading pauses while the step runs (hold_input).
        """
        assert self.transport is not None
        self.stepped_in = session_id
        self.send(FRAME_STEP, response.SerializeToString())
        if self.transport.is_closing():  # (this side closes only after an error frame: the write failed)
            self.service._answer_lost(session_id)
        elif self.transport.get_write_buffer_size():
            self.unsent_answer = session_id

    def send(self, kind: int, payload: bytes) -> None:
        """Write a frame of ``kind`` holding ``payload``.

        A large one (over _JOIN_BYTES: an Atari-sized batch of observations, say) is written as its
        header, then its payload as it is, the socket's send buffer grown to take it at once: joining
        them copied the answer into a new object, and what the socket did not take at once asyncio
        copied again, sending it over several turns of the loop as the learner read it. Its payload is
        kept until the next one: freed at once, it and the answer's other buffers (the message, the
        observations' bytes) left the top of the heap free, which glibc gave back to the system after
        every answer (above its trim threshold) and took again at the next, each page of it faulted in
        anew. For 8 x 210x160x3 uint8 observations: ~800 page faults and ~2.5 ms of the server's CPU a
        step, against none and ~0.5 ms now (gRPC's path: ~0.8 ms)."""
        assert self.transport is not None
        header = FRAME_HEADER.pack(len(payload), kind)
        if len(payload) <= _JOIN_BYTES:
            self.transport.write(header + payload)  # (one write: the learner wakes once, to the whole frame)
            return
        self.fit_send_buffer(len(header) + len(payload))
        self.transport.write(header)
        # (a view: on Python 3.12+ what the socket does not take at once is kept as it is; 3.11's transport
        # copies that rest into its buffer, as for a joined frame)
        self.transport.write(memoryview(payload))
        self._last_payload = payload

    def fit_send_buffer(self, size: int) -> None:
        """Grow the socket's send buffer (SO_SNDBUF) to take a frame of ``size`` bytes at once, where the
        system lets it (net.core.wmem_max caps what is asked: under Linux's default, 208 KiB, it holds
        416 KiB). What it costs is kernel memory while the learner has not read its answer: one answer's
        worth, about, per connection, and MAX_CONNECTIONS of them at most."""
        if size <= self._send_buffer_asked:
            return
        self._send_buffer_asked = size + size // 4  # (room for answers a little larger: infos vary)
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError):
            # (the kernel grants, and reports, twice what is asked, for its bookkeeping: see socket(7))
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 2 * self._send_buffer_asked:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_asked)

    def holds(self, session_id: str) -> bool:
        """Whether this connection serves session ``session_id``: a step of it went through here, or is in progress."""
        if self.closed:
            return False
        return self.stepped_in == session_id or (self.task is not None and self.session_id == session_id)

    def end_session(self, err: ServiceError) -> None:
        """The session ended: send ``err`` (not logged as a refusal: nothing was asked) and close, or,
        with a step in progress, once it is answered."""
        if self.closed:
            return
        if self.task is not None:
            self.ending = err
            return
        self.close_with(err.code, str(err), None)

    def fail(self, err: Exception) -> None:
        """Send the status ``err`` means as a StepError, then close (as a status ends a StepStream)."""
        if self.closed:
            return
        code, message, env_index = self.service.status(err, "StepStream", peer=self.peer, session_id=self.session_id)
        self.close_with(code, message, env_index)

    def close_with(self, code: grpc.StatusCode, message: str, env_index: int | None) -> None:
        """Send a StepError of ``code``, then close after what is buffered is written."""
        self.send(
            FRAME_ERROR, pb.StepError(code=code.value[0], message=message, env_index=env_index).SerializeToString()
        )
        self.closed = True
        with contextlib.suppress(ValueError):
            self.owner.connections.remove(self)
        assert self.transport is not None
        self.transport.close()  # after what is buffered is written

    def drain(self) -> None:
        if self.task is None:
            self.fail(shutting_down())

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _describe_peer(transport: asyncio.Transport) -> str:
    """Who connected, for log lines: ``pid N on the step socket`` (the kernel's record), or ``the step socket``."""
    sock = transport.get_extra_info("socket")
    peer_cred = getattr(socket, "SO_PEERCRED", None)  # (Linux)
    if sock is None or peer_cred is None:
        return "the step socket"
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, peer_cred, struct.calcsize("3i")))
    except OSError:
        return "the step socket"
    return f"pid {pid} on the step socket"


def _too_large(what: str, limit: int) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"step socket: {what}, over this server's limit of {limit} bytes on requests "
        "(env-server --max-request-bytes raises it)",
    )


def _too_many() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"step socket: {MAX_CONNECTIONS} connections are open already, each of which has stepped in the current "
        "session; close one, or step over gRPC",
    )


def _session_ended(session_id: str, reason: str) -> ServiceError:
    """What a connection of a session that ended is told (what a step of it would be told, and why)."""
    return ServiceError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"session {session_id[:8]!r} {NOT_OWNED} any more ({reason}); call Handshake again",
    )
