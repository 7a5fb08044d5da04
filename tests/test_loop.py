"""LoopRunner: the event loop a thread runs for RemoteVectorEnv's synchronous calls."""

from __future__ import annotations

import _weakrefset
import asyncio
import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType
from typing import Any

import grpc
import numpy as np
import pytest

import learner.client
import learner.connecting
import learner.interrupts
import learner.loop
from env_server.health import check
from learner import faults
from learner.errors import RemoteEnvError
from learner.loop import LoopRunner
from learner.remote import RemoteVectorEnv
from tests.conftest import StartServers, needs_proc, slow_to_build_server
from tests.faulty_server import Faults, FaultyServer


def test_a_close_from_another_thread_runs_at_once_when_the_loop_is_free() -> None:
    """An env made in one thread and closed from a worker thread (or by a garbage collection there):
    its close runs then, in that thread, so its servers are released even if the owner never calls
    again."""
    runner = LoopRunner.for_this_thread()
    ran_in: list[threading.Thread] = []

    async def close() -> None:
        ran_in.append(threading.current_thread())

    worker = threading.Thread(target=runner.run_or_schedule, args=(close(),))
    worker.start()
    worker.join()
    assert ran_in == [worker]
    runner.run(asyncio.sleep(0))  # (the owner's loop is its own again)


def test_a_close_from_another_thread_while_the_owner_runs_the_loop_waits_for_its_next_run() -> None:
    """A finalizer run by a garbage collection on another thread while the owner runs the loop must
    not run it too (the owner's call would fail "This event loop is already running"): it is
    scheduled, and runs on the owner's loop."""
    runner = LoopRunner.for_this_thread()
    ran_in: list[threading.Thread] = []

    async def close() -> None:
        ran_in.append(threading.current_thread())

    async def owner_call() -> None:
        collector = threading.Thread(target=runner.run_or_schedule, args=(close(),))
        collector.start()
        collector.join()
        assert ran_in == []

    runner.run(owner_call())
    runner.run(asyncio.sleep(0.01))  # the owner's next call
    assert ran_in == [threading.current_thread()]


def _runner_loop_in_a_thread(keep: list[LoopRunner] | None = None) -> asyncio.AbstractEventLoop:
    """The loop of the runner a new thread gets (its runner kept in ``keep``, if given), once it ended."""
    got: list[LoopRunner] = []
    thread = threading.Thread(target=lambda: got.append(LoopRunner.for_this_thread()))
    thread.start()
    thread.join()
    if keep is not None:
        keep.append(got[0])
    return got[0].loop


def test_a_thread_that_ended_leaves_its_loop_to_the_next_one_unless_an_env_still_holds_its_runner() -> None:
    """gRPC keeps every loop that made a call: a loop per short-lived thread (a trial of a sweep, a
    ThreadPoolExecutor per run) would never be freed. The next thread takes it over instead; not
    while something made on it (an env keeps its runner) is still there."""
    first = _runner_loop_in_a_thread()
    assert _runner_loop_in_a_thread() is first
    held: list[LoopRunner] = []
    assert _runner_loop_in_a_thread(keep=held) is first  # (its runner still held, as by an env)
    assert _runner_loop_in_a_thread() is not first
    held.clear()
    assert first in {_runner_loop_in_a_thread(), _runner_loop_in_a_thread()}


@needs_proc
def test_fleets_made_in_threads_that_end_leave_no_file_descriptors_behind(start_servers: StartServers) -> None:
    """Each thread opens a fleet, steps it and closes it, then ends (as a sweep's trials on fresh
    threads do): the process's open files stay bounded, not ~3 more per thread (a loop each)."""
    address = start_servers("CartPole-v1", envs_per_server=2)[0]

    def trial() -> None:
        with RemoteVectorEnv([address]) as envs:
            envs.reset(seed=0)
            for _ in range(5):
                envs.step(envs.action_space.sample())

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    def in_threads(count: int) -> None:
        for _ in range(count):
            thread = threading.Thread(target=trial)
            thread.start()
            thread.join()

    in_threads(3)  # (gRPC's own threads and files, made once)
    before = open_files()
    in_threads(30)
    # (~100 more when each thread's loop stayed; a few connections of closes still in flight otherwise)
    assert open_files() - before < 40, (before, open_files())


def test_a_runner_freed_by_a_garbage_collection_while_a_thread_makes_its_own_hangs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An env in a reference cycle (a train() run's) keeps its runner until a garbage collection,
    which may come at any allocation: here, while another thread makes its loop. That frees the
    runner, whose loop goes to the spare ones then and there: nothing may wait on a lock held meanwhile."""

    class Cycle:
        def __init__(self, runner: LoopRunner) -> None:
            self.runner, self.me = runner, self

    gc.disable()
    try:
        thread = threading.Thread(target=lambda: Cycle(LoopRunner.for_this_thread()))
        thread.start()
        thread.join()
        made = asyncio.new_event_loop

        def collecting() -> asyncio.AbstractEventLoop:
            gc.collect()  # (as one an allocation in there starts would)
            return made()

        monkeypatch.setattr(asyncio, "new_event_loop", collecting)
        monkeypatch.setattr(learner.loop, "_spare", [])
        got: list[LoopRunner] = []
        other = threading.Thread(target=lambda: got.append(LoopRunner.for_this_thread()), daemon=True)
        other.start()
        other.join(10)
        assert got and not other.is_alive()
    finally:
        gc.enable()


def test_an_interrupted_call_is_cancelled_and_its_cleanup_run_before_the_interrupt_goes_on() -> None:
    """Ctrl-C while the loop runs a call: the call must not stay pending, to resume unseen at the loop's
    next run (a connect that then claims a server for an env nobody holds); its cleanup runs first."""
    runner = LoopRunner.for_this_thread()
    ended: list[str] = []

    async def call() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.01)  # (a cleanup that awaits: closing its channels)
            ended.append("cleaned up")

    def interrupt() -> None:
        raise KeyboardInterrupt  # (as the default SIGINT handler raises it, the loop waiting in select)

    runner.loop.call_later(0.05, interrupt)
    with pytest.raises(KeyboardInterrupt):
        runner.run(call())
    assert ended == ["cleaned up"]
    runner.run(asyncio.sleep(0))  # (the loop is free for the next call)


def _serving(address: str) -> bool:
    """Whether the server at ``address`` says it serves; False while it does not answer yet (a loaded machine's
    server may not be listening until seconds after it was started)."""
    try:
        return check(address) == "SERVING"
    except grpc.RpcError:
        return False


@pytest.fixture
def runner() -> Iterator[LoopRunner]:
    """A LoopRunner of a loop of its own, closed after the test (a thread's shared loop is never closed: see
    LoopRunner)."""
    loop = asyncio.new_event_loop()
    yield LoopRunner(loop)
    loop.close()


@pytest.fixture
def ctrl_c() -> Iterator[Callable[[float], threading.Timer]]:
    """``ctrl_c(after)``: a Ctrl-C (SIGINT, raising KeyboardInterrupt) to the main thread ``after`` seconds
    from now (a timer: join it); Python's handler put back meanwhile, as a program may (the runs of the main
    thread's loop take it over again: see learner.interrupts.take_ctrl_c)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    assert main is not None
    timers: list[threading.Timer] = []

    def press(after: float) -> threading.Timer:
        timer = threading.Timer(after, signal.pthread_kill, (main, signal.SIGINT))
        timers.append(timer)
        timer.start()
        return timer

    yield press
    for timer in timers:
        timer.cancel()
        timer.join()
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["this-thread", "background-loop"])
def test_ctrl_c_while_connecting_leaves_the_server_free(
    ctrl_c: Callable[[float], threading.Timer], background: bool
) -> None:
    """Ctrl-C while RemoteVectorEnv(...) waits for a server building its envs (a notebook's interrupt), then
    the cell run again once the server is up: the interrupted connect must not claim it meanwhile, on the
    thread's loop's next run, or (a notebook's: an event loop runs in the thread) on the background loop."""
    build_s = 3.0
    with slow_to_build_server(build_s, 2) as address:

        def connect() -> None:
            timer = ctrl_c(2.0)  # (the connect waits for it then, retrying its handshake)
            with pytest.raises(KeyboardInterrupt):
                RemoteVectorEnv(address, connect_timeout=30)
            timer.join()

        if background:

            async def in_a_notebook() -> None:
                connect()  # (blocking the loop, as a notebook's cell does: the env runs on the background loop)

            loop = asyncio.new_event_loop()  # (asyncio.run would take the Ctrl-C for itself)
            try:
                loop.run_until_complete(in_a_notebook())
            finally:
                loop.close()
        else:
            connect()
        while not _serving(address):  # (asked apart from the loop: what it had pending stays so)
            time.sleep(0.1)
        # The thread's loop runs (what it had pending, too: a handshake retried within 1 s).
        LoopRunner.for_this_thread().run(asyncio.sleep(1.5))
        with RemoteVectorEnv(address, connect_timeout=10) as envs:
            assert envs.num_envs == 2


def _ctrl_c_to_the_main_thread() -> None:
    """A Ctrl-C (SIGINT) to the main thread, from any thread (a FaultyServer's Handshake: see Faults.handshake_hook)."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signal.SIGINT)


def _ctrl_c_once(condition: Callable[[], bool], within: float = 10.0) -> threading.Thread:
    """A second Ctrl-C to the main thread once ``condition()`` holds (or ``within`` seconds have passed: the old
    code's case, which the test then fails on), from a thread started now: join it. Not after a fixed delay: on a
    loaded machine the main thread may not have taken the first Ctrl-C by then, and two pending SIGINTs are one."""

    def wait_then_press() -> None:
        end = time.monotonic() + within
        while not condition() and time.monotonic() < end:
            time.sleep(0.01)
        _ctrl_c_to_the_main_thread()

    thread = threading.Thread(target=wait_then_press, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_while_handshakes_are_in_flight_releases_every_session_they_granted(
    ctrl_c: Callable[[float], threading.Timer],
) -> None:
    """Ctrl-C while RemoteVectorEnv(...)'s Handshakes are in flight, one server's answered, the other's granted
    but not answered yet: the sessions of both are released before the KeyboardInterrupt goes on. Cancelled with
    the connect, the second's answer was dropped, and its server held the claim, with nobody to release it and no
    Hold stream, for its --claim-timeout (30 s: the learner started again was refused meanwhile; 1-2 of 30
    connects interrupted in a fuzz); nor was the first's, read but not taken up yet, released."""
    del ctrl_c  # (the default handler meanwhile: the Ctrl-C comes from the slow server's Handshake)
    slow_faults = Faults(handshake_hook=_ctrl_c_to_the_main_thread, handshake_delay_s=0.3)
    with FaultyServer() as fast, FaultyServer(slow_faults) as slow:
        with pytest.raises(KeyboardInterrupt):
            RemoteVectorEnv([fast.address, slow.address], connect_timeout=10)
        # (released before the interrupt went on: nothing runs the loop meanwhile)
        for server in (fast, slow):
            assert len(server.service.granted) == 1
            assert server.service.released == server.service.granted
        slow.faults.handshake_hook = None  # (the learner started again: not interrupted)
        with RemoteVectorEnv([fast.address, slow.address], connect_timeout=10) as envs:
            assert envs.num_envs == 4


def test_a_second_ctrl_c_ends_the_wait_for_handshake_answers_at_once(
    ctrl_c: Callable[[float], threading.Timer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for the answers of Handshakes in flight at a Ctrl-C (to release their sessions) ends at a second
    Ctrl-C, as any cleanup after an interrupt does: the server's session is left to its claim timeout then."""
    del ctrl_c  # (the default handler meanwhile)
    monkeypatch.setattr(learner.client, "HANDSHAKE_ANSWER_WAIT_S", 60.0)  # (far longer than the test waits)
    releasing = threading.Event()  # (the first Ctrl-C taken: the connect given up, its wait begun)
    release_unadopted = learner.connecting.release_unadopted

    async def entered(*args: Any) -> None:
        releasing.set()
        await release_unadopted(*args)

    monkeypatch.setattr(learner.connecting, "release_unadopted", entered)  # (the connect's)
    again: list[threading.Thread] = []

    def twice() -> None:  # (the first Ctrl-C now, the Handshake in flight; the second during the wait after it)
        again.append(_ctrl_c_once(releasing.is_set))  # (waiting from now: listed before the first can end the test)
        _ctrl_c_to_the_main_thread()

    with FaultyServer(Faults(handshake_hook=twice, handshake_delay_s=60.0)) as server:
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            RemoteVectorEnv(server.address, connect_timeout=10)
        assert time.monotonic() - started < 30  # (not the 60 s wait: a hang guard, not a timing)
        assert again and server.service.released == []  # (the wait was given up before the answer came)
        again[0].join()
    LoopRunner.for_this_thread().run(asyncio.sleep(0.2))  # (what the loop had pending ends: the server is gone)


def test_a_second_ctrl_c_leaves_no_session_already_answered_held(
    ctrl_c: Callable[[float], threading.Timer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers, one answers its Handshake, the other hangs on its own: a Ctrl-C, then a second one during the
    wait for the hanging one's answer. The answered session is released at once, not after that wait: the second
    Ctrl-C, leaving the cleanup where it is, left it held (for the server's claim timeout) with the other."""
    del ctrl_c  # (the default handler meanwhile)
    monkeypatch.setattr(learner.client, "HANDSHAKE_ANSWER_WAIT_S", 60.0)  # (far longer than the test waits)
    again: list[threading.Thread] = []
    fast = FaultyServer()

    def twice() -> None:  # (the first Ctrl-C now, the Handshake in flight; the second during the wait after it, once
        # the fast server has its Release, or 10 s on: the old code released it only after the wait)
        again.append(_ctrl_c_once(lambda: bool(fast.service.released)))
        _ctrl_c_to_the_main_thread()

    with fast, FaultyServer(Faults(handshake_hook=twice, handshake_delay_s=60.0)) as slow:
        with pytest.raises(KeyboardInterrupt):
            RemoteVectorEnv([fast.address, slow.address], connect_timeout=10)
        again[0].join()
        end = time.monotonic() + 10  # (the Release went out before the second Ctrl-C; the server logs it on its thread)
        while not fast.service.released and time.monotonic() < end:
            time.sleep(0.01)
        assert len(fast.service.granted) == 1 and fast.service.released == fast.service.granted
        assert slow.service.released == []  # (the wait for it was given up)
    LoopRunner.for_this_thread().run(asyncio.sleep(0.2))  # (what the loop had pending ends: the servers are gone)


def _claims_at_once(*servers: FaultyServer) -> None:
    """A learner started again claims ``servers`` at once: none holds a session left unreleased (the servers are
    ``Faults.exclusive``: an envfleet server refuses the next learner until its claim timeout, 30 s by default)."""
    for server in servers:
        server.faults.handshake_hook = server.faults.reset_hook = None  # (not interrupted, this time)
        server.faults.handshake_delay_s = server.faults.reset_delay_s = 0.0
    with RemoteVectorEnv([s.address for s in servers], connect_timeout=5) as envs:
        assert envs.num_envs == 2 * len(servers)


@contextlib.contextmanager
def _a_server_to_join() -> Iterator[tuple[FaultyServer, FaultyServer, RemoteVectorEnv]]:
    """Exclusive FaultyServers ``a`` and ``b``, and a fault-tolerant fleet of ``a`` whose start went on without
    ``b`` (another learner held it, and has let go since: ``b`` joins at a refresh once its backoff is over). The
    fleet closed after the block, a learner started again must claim both at once (:func:`_claims_at_once`)."""
    with FaultyServer(Faults(exclusive=True)) as a, FaultyServer(Faults(exclusive=True, claimed=True)) as b:
        with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, connect_timeout=5) as envs:
            assert envs.servers_not_joined == [b.address]
            envs.reset(seed=0)
            b.faults.claimed = False  # (the other learner let go)
            yield a, b, envs
        _claims_at_once(a, b)


@pytest.mark.parametrize("everyone", [False, True], ids=["joining", "no-server-left"])
def test_ctrl_c_while_a_joining_server_s_handshake_is_in_flight_releases_the_session_it_granted(
    ctrl_c: Callable[[float], threading.Timer], monkeypatch: pytest.MonkeyPatch, everyone: bool
) -> None:
    """Ctrl-C while refresh()'s Handshake to a server joining the fleet (one the fault-tolerant start went on
    without: another learner held it) is in flight, its session granted but not answered yet: the session is
    released before the interrupt goes on. Cancelled with the refresh, the answer was dropped (the client it was
    for too), and the server held the claim, with nobody to release it and no Hold stream, for its claim timeout,
    refusing the learner started again. ``everyone``: the fleet's own server dropped too, so that the refresh's
    last try (every server listed, at once, until one joins) makes the Handshake."""
    del ctrl_c  # (the default handler meanwhile: the Ctrl-C comes from the joining server's Handshake)
    # (everyone: tried by the last try only, not by the refresh's first, while its backoff runs)
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (60.0, 60.0) if everyone else (0.05, 0.1))
    with _a_server_to_join() as (a, b, envs):
        b.faults.handshake_hook, b.faults.handshake_delay_s = _ctrl_c_to_the_main_thread, 0.3
        if everyone:
            a.faults.claimed = True  # (a, dropped, is refused as it joins again: no server left)
        else:
            time.sleep(0.1)  # (b's backoff over)
        with pytest.raises(KeyboardInterrupt):
            envs.refresh(drop=[a.address] if everyone else ())
        # (released before the interrupt went on: nothing runs the loop meanwhile)
        assert len(b.service.granted) == 1 and b.service.released == b.service.granted
        a.faults.claimed = False


def test_ctrl_c_while_a_joining_server_s_reset_is_in_flight_releases_its_session(
    ctrl_c: Callable[[float], threading.Timer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while refresh() resets a server joining the fleet, its Handshake answered and its session taken up
    (its Hold stream open): the session is released before the interrupt goes on, and the fleet is as it was. The
    joining client, in none of the fleet's lists yet, was dropped with its session: no close released it, and its
    Hold stream kept the claim for as long as its connection lived (the process's life: a notebook's kernel)."""
    del ctrl_c  # (the default handler meanwhile: the Ctrl-C comes from the joining server's Reset)
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (0.05, 0.1))
    with _a_server_to_join() as (a, b, envs):
        b.faults.reset_hook, b.faults.reset_delay_s = _ctrl_c_to_the_main_thread, 0.3
        time.sleep(0.1)  # (b's backoff over)
        with pytest.raises(KeyboardInterrupt):
            envs.refresh()
        # (released before the interrupt went on: nothing runs the loop meanwhile)
        assert len(b.service.granted) == 1 and b.service.released == b.service.granted
        assert (envs.addresses, envs.num_envs) == ([a.address], 2)


def test_ctrl_c_while_a_session_s_renewal_handshake_is_in_flight_releases_the_session_it_granted(
    ctrl_c: Callable[[float], threading.Timer],
) -> None:
    """Ctrl-C while reset()'s Handshake renewing a session that ended (the server dropped it: here, its claim
    timed out) is in flight, the new session granted but not answered yet: that session is released before the
    interrupt goes on. Cancelled with the reset, the answer was dropped, and the server held the new claim, with
    nobody to release it and no Hold stream, for its claim timeout, refusing the learner started again (the
    client's close releases the old session only)."""
    del ctrl_c  # (the default handler meanwhile: the Ctrl-C comes from the server's Handshake)
    with FaultyServer(Faults(exclusive=True)) as server:
        with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
            envs.reset(seed=0)
            server.service.drop_sessions()
            with pytest.raises(RemoteEnvError, match="does not own this server"):
                envs.step(np.zeros(2, dtype=np.int64))
            server.faults.handshake_hook, server.faults.handshake_delay_s = _ctrl_c_to_the_main_thread, 0.3
            with pytest.raises(KeyboardInterrupt):
                envs.reset(seed=0)
            # (released before the interrupt went on: nothing runs the loop meanwhile)
            renewal = server.service.granted[1]
            assert len(server.service.granted) == 2 and renewal in server.service.released
        _claims_at_once(server)


def test_a_close_while_a_reconnect_s_handshake_is_in_flight_releases_the_session_it_granted() -> None:
    """A fault-tolerant fleet closed (learner train's, after a Ctrl-C) while a lost server's reconnect, in the
    background, waits for its Handshake's answer: the session it granted should be released, as the start's are,
    and the learner started again claim the server at once."""
    in_flight = threading.Event()
    with FaultyServer(Faults(exclusive=True)) as a, FaultyServer(Faults(exclusive=True)) as b:
        with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, connect_timeout=5) as envs:
            envs.reset(seed=0)
            b.service.drop_sessions()  # (lost at the next step: its reconnect starts)
            b.faults.handshake_hook, b.faults.handshake_delay_s = in_flight.set, 1.0
            end = time.monotonic() + 10
            while not in_flight.is_set() and time.monotonic() < end:  # (the loop runs during steps only)
                envs.step(np.zeros(4, dtype=np.int64))
                time.sleep(0.02)
            assert in_flight.is_set()
        end = time.monotonic() + 5  # (the Release, if any, is logged on the server's thread)
        while b.service.granted[-1] not in b.service.released and time.monotonic() < end:
            time.sleep(0.05)
        assert len(b.service.granted) == 2 and b.service.granted[-1] in b.service.released
        _claims_at_once(a, b)


# Run in a process of its own: without the fix the wait below never ends (the task's wakeup is lost).
_STOP_INSIDE_A_GRPC_CALLBACK = r"""
import asyncio, signal, sys
from concurrent import futures

import grpc

from learner import faults
from learner.errors import RemoteEnvError
from learner.loop import LoopRunner
from learner.progress import ending_as_interrupt

server = grpc.server(futures.ThreadPoolExecutor(1))
port = server.add_insecure_port("127.0.0.1:0")
server.start()


class Loop(asyncio.SelectorEventLoop):
    # The signal arrives while gRPC's completion callback (Cython, noexcept) hands a finished call's
    # result to the task waiting for it: its handler runs at the next Python line, inside the callback.
    fired = False
    signum = signal.SIGTERM

    def call_soon(self, callback, *args, context=None):
        running = getattr(sys._getframe(1).f_locals.get("self"), "_callback", None)  # (a Handle's)
        running = getattr(running, "func", running)  # (a functools.partial's)
        if not self.fired and getattr(running, "__name__", "") == "_handle_events":
            self.fired = True
            signal.raise_signal(self.signum)
        return super().call_soon(callback, *args, context=context)


async def connect():
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await asyncio.wait_for(channel.channel_ready(), 10)
        await asyncio.sleep(10)  # (the interrupt comes first)
    finally:
        await channel.close()


try:
    if sys.argv[1] == "command":  # (learner train's: SIGTERM taken as Ctrl-C)
        with ending_as_interrupt():
            loop = Loop()
            LoopRunner(loop).run(connect())
    else:  # a script's, Ctrl-C left to Python: the runner its first fleet makes takes it over
        runner = LoopRunner.for_this_thread()
        loop = runner.loop
        loop.__class__, Loop.signum = Loop, signal.SIGINT
        runner.run(connect())
    print("not interrupted", loop.fired)
except KeyboardInterrupt:
    print("interrupted", loop.fired)
server.stop(None)
"""


@pytest.mark.parametrize("whose", ["command", "script"])
def test_a_stop_signal_whose_handler_runs_inside_a_grpc_callback_interrupts_and_loses_no_wakeup(whose: str) -> None:
    """A command's SIGTERM (or Ctrl-C), or a script's Ctrl-C, whose handler ran inside one of gRPC's
    completion callbacks: the KeyboardInterrupt raised there was printed and swallowed by the callback,
    with the wakeup of the task that waited for the call, which then waited for ever (a learner stopped
    while it waited for its servers ran on, stuck: a CI run's timeout; a script stepping a fleet over TCP
    hung on about one Ctrl-C in ten). The interrupt now comes as the loop's next callback."""
    done = subprocess.run(
        [sys.executable, "-c", _STOP_INSIDE_A_GRPC_CALLBACK, whose], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "interrupted True", done
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_an_interrupt_left_for_one_thread_s_loop_is_not_raised_in_another_s(runner: LoopRunner) -> None:
    """A signal's interrupt left for the main thread's loop (its handler ran while that loop ran) is
    raised there, not by a call another thread makes on its own loop meanwhile (the flag was one for
    all: a worker took the KeyboardInterrupt, and the main thread ran on)."""
    worker_raised: list[bool] = []

    def worker() -> None:
        try:
            LoopRunner.for_this_thread().run(asyncio.sleep(0))
            worker_raised.append(False)
        except KeyboardInterrupt:
            worker_raised.append(True)

    async def main() -> None:
        learner.interrupts.interrupt()  # (as the handler does, the loop running)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()  # (the loop blocked meanwhile, as by synchronous code)
        await asyncio.sleep(5)  # (the interrupt comes first)

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        runner.run(main())
    assert worker_raised == [False] and time.monotonic() - started < 5


def test_an_interrupt_in_a_loop_not_a_runner_s_is_raised_at_once() -> None:
    """Where the main thread runs a loop of the caller's own (asyncio.run, a notebook's kernel), the
    interrupt is raised where the code is, as before: that loop may not get control back for long (a
    fleet's step runs synchronously inside it)."""

    async def main() -> str:
        try:
            learner.interrupts.interrupt()
        except KeyboardInterrupt:
            return "at once"
        return "deferred"

    assert asyncio.run(main()) == "at once"


def test_the_main_thread_s_first_runner_takes_over_ctrl_c_only_where_python_has_it() -> None:
    """A script's Ctrl-C (Python's default handler) is taken over by a handler that raises the same
    KeyboardInterrupt by way of interrupt(); a program's own handler is left alone."""
    before = signal.getsignal(signal.SIGINT)
    try:

        def own(signum: int, frame: object) -> None:
            pass

        signal.signal(signal.SIGINT, own)
        learner.interrupts.take_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        learner.interrupts.take_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is learner.interrupts._interrupt_on_signal
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_after_the_program_put_python_s_handler_back_is_not_raised_inside_a_task() -> None:
    """A program that put Python's Ctrl-C handler back after its first fleet was made (a library's signal handling
    restoring what it found): each run of the main thread's loop takes Ctrl-C over again. Python's raised the
    KeyboardInterrupt wherever the main thread was, inside a task too: in a connect's Handshake, its answer read,
    the task's outcome was the interrupt, and the session granted was never released (held for the server's claim
    timeout). Now the task goes on to its next wait, and the run raises the KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    runner = LoopRunner.for_this_thread()  # (the first fleet's: it took Ctrl-C over, once)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (put back)
    went_on: list[bool] = []

    async def task() -> None:
        signal.raise_signal(signal.SIGINT)  # (its handler runs here, as the call returns)
        went_on.append(True)  # (the answer taken in, as a Handshake's task would)
        await asyncio.sleep(5)

    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(task)
        assert went_on == [True]
        assert signal.getsignal(signal.SIGINT) is learner.interrupts._interrupt_on_signal
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize(
    "handler",
    [learner.interrupts._interrupt_on_signal, signal.default_int_handler],
    ids=["taken-over", "python-s"],
)
def test_a_ctrl_c_whose_signal_does_not_end_the_main_thread_s_wait_interrupts_it_at_once(
    handler: Callable[[int, FrameType | None], None],
) -> None:
    """A Ctrl-C interrupts a call the main thread waits on, though its signal did not end the loop's wait in the
    system: Python runs the handler only once the main thread runs Python code again, and a signal handled by
    another thread (as a process's signal may be: macOS picks any thread), or one that came as the loop was
    about to wait, woke nothing; the handler ran when the wait ended by itself (the call's deadline: a second
    Ctrl-C while a connect released its claims waited 10-30 s so, 1 run in 6 of test_loop.py beside another
    pytest worker). Its arrival now wakes the loop (a wakeup fd)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    previous = signal.signal(signal.SIGINT, handler)
    try:
        # (the signal's C handler runs in the thread it is sent to: this one, not the main thread)
        elsewhere = threading.Timer(0.2, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT))
        elsewhere.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            LoopRunner.for_this_thread().run(lambda: asyncio.sleep(20))
        assert time.monotonic() - started < 10  # (not the 20 s sleep: a hang guard, not a timing)
        elsewhere.join()
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("where", ["background-loop", "helper-thread"])
def test_a_ctrl_c_taken_by_another_thread_interrupts_a_call_run_off_the_main_thread_at_once(where: str) -> None:
    """A Ctrl-C whose signal another thread took (macOS gives a process's signal to any thread) interrupts a call
    the main thread waits for while another thread runs it: on the background loop (the main thread runs a loop of
    its own, a notebook's kernel say), or on a helper thread (a fleet made outside ``asyncio.run``, used inside
    it). That signal sets Python's flag but wakes no lock wait, and the handler ran only once the call ended by
    itself (here a 20 s sleep; for a hanging server, the call's deadline)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    outside = LoopRunner.for_this_thread()  # (the main thread's own: made outside, used inside asyncio.run)

    async def main() -> None:
        runner = LoopRunner.for_this_thread() if where == "background-loop" else outside
        assert (runner._thread is not None) == (where == "background-loop")
        runner.run(lambda: asyncio.sleep(20))

    # (the signal's C handler runs in the thread it is sent to: the timer's, not the main thread)
    elsewhere = threading.Timer(0.2, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT))
    elsewhere.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert time.monotonic() - started < 10  # (not the 20 s sleep: a hang guard, not a timing)
    elsewhere.join()


def test_a_ctrl_c_during_a_helper_thread_s_call_waits_for_its_cleanup_and_leaves_the_loop_free() -> None:
    """A Ctrl-C while a helper thread runs the call (a fleet made outside ``asyncio.run``, used inside it): the call is
    cancelled, and the interrupt raised once its cleanup (a connect's release of its claims, up to 2 s) is over, the
    loop free for the program's next call (the fleet's close). Python 3.11's ``Thread.join``, interrupted, took the
    helper for ended though it still ran the loop: the wait for the cleanup returned at once, and the next call
    failed "This event loop is already running" (the fleet's close so, its servers left claimed)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    outside = LoopRunner.for_this_thread()  # (the main thread's own: made outside, used inside asyncio.run)
    cleaned: list[bool] = []

    async def call() -> None:
        try:
            await asyncio.sleep(20)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # (a cleanup that waits, as a release does for its answer)
            cleaned.append(True)
            raise

    async def main() -> None:
        outside.run(call)

    # (the taken-over handler, as a script's: asyncio.run then keeps it rather than install its own)
    previous = signal.signal(signal.SIGINT, learner.interrupts._interrupt_on_signal)
    try:
        timer = threading.Timer(0.2, _ctrl_c_to_the_main_thread)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main())
        timer.join()
        assert cleaned == [True] and not outside.loop.is_running()
        assert outside.run(_a_later_call) == "done"
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_at_bytecode(
    point: int, traced: Callable[[FrameType], bool], interrupt: Callable[[FrameType], None], call: Callable[[], Any]
) -> tuple[bool, int]:
    """``call()`` with ``interrupt(frame)`` run at the ``point``-th bytecode (from 1) of the frames ``traced`` takes,
    as a signal's handler runs there: whether the call raised KeyboardInterrupt, and how many such bytecodes ran.
    (Python 3.12 emits opcode events only where a frame asked for them, f_trace_opcodes, before sys.settrace was
    called, not where the tracer asks as a frame begins: CPython's gh-114480; 3.11 and 3.13 do. So the caller's
    frame asks, and gets none itself: it has no trace function of its own.)"""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if not traced(frame):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
            if count == point:
                interrupt(frame)
        return tracer

    caller = sys._getframe(1)
    caller.f_trace_opcodes = True
    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        return True, count
    finally:
        sys.settrace(None)
        caller.f_trace_opcodes = False
    return False, count


@pytest.mark.slow
@pytest.mark.parametrize("where", ["background-loop", "helper-thread"])
def test_a_ctrl_c_at_each_bytecode_of_the_main_thread_s_wait_ends_the_call_whole(where: str) -> None:
    """A Ctrl-C handled at any bytecode of the main thread's wait for a call another thread runs (the background
    loop's, a helper thread's: _awake_until_done), the first wait's or the one for the cancelled call's end: the
    interrupt is raised once the call's cleanup is over, and the next call runs."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    outside = LoopRunner.for_this_thread()  # (the main thread's own: made outside, used inside a loop of ours)
    waiting = learner.loop._awake_until_done.__code__
    cleaned: list[bool] = []

    async def call() -> None:
        try:
            await asyncio.sleep(0.3)  # (the wait wakes once meanwhile: SIGNAL_LOOK_S)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            cleaned.append(True)
            raise

    async def main() -> None:
        runner = LoopRunner.for_this_thread() if where == "background-loop" else outside
        assert (runner._thread is not None) == (where == "background-loop")
        point, interrupted = 0, True
        while interrupted:  # (until a point past the waits' last bytecode: the call ran whole)
            point += 1
            cleaned.clear()
            interrupted, count = _interrupted_at_bytecode(
                point,
                lambda frame: frame.f_code is waiting,
                lambda frame: learner.interrupts.interrupt(),  # (raised at once: the loop running here is not ours)
                lambda: runner.run(call),
            )
            assert interrupted or count < point, f"the Ctrl-C at bytecode {point} was lost"
            at_the_interrupt = list(cleaned)  # (the cleanup over already, or never begun: the call cancelled unstarted)
            time.sleep(0.1)
            assert cleaned == at_the_interrupt, f"the call still ran after the Ctrl-C at bytecode {point}"
            assert runner.run(_a_later_call) == "done", point
        assert point > 10  # (the test reached the wait's inside)

    loop = asyncio.new_event_loop()  # (a loop of the caller's own, as a notebook's: asyncio.run's takes Ctrl-C)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.slow
def test_a_ctrl_c_as_the_helper_thread_starts_ends_its_call_whole() -> None:
    """A Ctrl-C handled at any bytecode of the helper thread's start (a fleet made outside ``asyncio.run``, used
    inside it; Thread.start waits for the thread to begin): the call, scheduled already, is cancelled and its
    cleanup run before the interrupt is raised, or it never runs, and the loop is free for the next call. Raised
    there, the interrupt left the call to run on the helper unseen: the program's next call (the fleet's close)
    failed "This event loop is already running". Python's handler put back meanwhile, as a program may."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    outside = LoopRunner.for_this_thread()  # (the main thread's own: made outside, used inside a loop of ours)
    starting = {threading.Thread.start.__code__, threading.Event.wait.__code__}
    ran: list[bool] = []
    cleaned: list[bool] = []

    def in_start(frame: FrameType) -> bool:  # (Event.wait only inside Thread.start: its wait for the thread to begin)
        inside: FrameType | None = frame
        while inside is not None and inside.f_code is not threading.Thread.start.__code__:
            inside = inside.f_back
        return frame.f_code in starting and inside is not None

    async def call() -> None:
        ran.append(True)
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            cleaned.append(True)
            raise

    async def main() -> None:
        point, interrupted = 0, True
        while interrupted:  # (until a point past the start's last bytecode: the call ran whole)
            point += 1
            ran.clear()
            cleaned.clear()
            signal.signal(signal.SIGINT, signal.default_int_handler)  # (put back: the call takes Ctrl-C over)
            interrupted, count = _interrupted_at_bytecode(
                point,
                in_start,
                lambda frame: learner.interrupts._interrupt_on_signal(signal.SIGINT, frame),  # (take_ctrl_c's)
                lambda: outside.run(call),
            )
            assert interrupted or count < point, f"the Ctrl-C at bytecode {point} was lost"
            time.sleep(0.05)  # (a call left running on the helper would have begun meanwhile)
            assert not interrupted or cleaned == ran, f"the call ran unseen after the Ctrl-C at bytecode {point}"
            assert outside.run(_a_later_call) == "done", point
        assert point > 20  # (the test reached the start's inside)

    previous = signal.getsignal(signal.SIGINT)
    loop = asyncio.new_event_loop()  # (a loop of the caller's own, as a notebook's: asyncio.run's takes Ctrl-C)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        signal.signal(signal.SIGINT, previous)


def test_the_wakeup_fd_is_the_loop_s_only_while_it_runs_and_the_program_s_own_gets_what_came_meanwhile() -> None:
    """The wakeup fd (see the test above) is the loop's only while the main thread runs it: the program's own (a
    loop of its own with signal handlers, asyncio's, say) is put back as the call ends, and gets the signals that
    came meanwhile, which its loop would have lost."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    theirs, their_end = socket.socketpair()
    their_end.setblocking(False)
    theirs.settimeout(5)
    got: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    outside = signal.set_wakeup_fd(their_end.fileno())
    try:

        async def signalled() -> int:
            installed = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(installed)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
            await asyncio.sleep(0.05)  # (the loop reads its wakeup fd meanwhile)
            return installed

        installed = LoopRunner.for_this_thread().run(signalled)
        assert installed not in (-1, their_end.fileno())
        assert signal.set_wakeup_fd(their_end.fileno()) == their_end.fileno()  # (theirs again)
        assert got == [signal.SIGUSR1] and theirs.recv(16) == bytes([signal.SIGUSR1])
    finally:
        signal.set_wakeup_fd(outside)
        signal.signal(signal.SIGUSR1, before)
        theirs.close()
        their_end.close()


def test_a_ctrl_c_at_any_point_of_the_wakeup_fd_s_swap_leaves_the_program_s_own_installed(runner: LoopRunner) -> None:
    """A Ctrl-C handled at each bytecode in turn of signals_wake (its making, its start, its end: CPython runs a
    signal's handler as a function begins and after each call from it, among them the swap's own) during one
    ``run``, with the program's own wakeup fd installed: the run is interrupted, nothing is left pending for the
    next call, and the program's fd is the wakeup fd again. Raised after the swap but before the block knew what it
    replaced, or as the block's end began, the interrupt left the loop's socket the wakeup fd for good: the next
    block took it for one inside another and put nothing back, and the program's own loop (asyncio's, with signal
    handlers) never heard of its signals again."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    theirs, their_end = socket.socketpair()
    their_end.setblocking(False)
    outside = signal.set_wakeup_fd(their_end.fileno())
    swap = {
        learner.interrupts.signals_wake.__init__.__code__,
        learner.interrupts.signals_wake.__enter__.__code__,
        learner.interrupts.signals_wake.__exit__.__code__,
    }

    async def call() -> None:
        await asyncio.sleep(0)

    try:
        point, interrupted = 0, True
        while interrupted:  # (until a point past the swap's last bytecode: it ran whole)
            point += 1
            interrupted, count = _interrupted_at_bytecode(
                point,
                lambda frame: frame.f_code in swap,
                lambda frame: learner.interrupts.interrupt(),  # (take_ctrl_c's handler, as it runs there)
                lambda: runner.run(call),
            )
            assert interrupted or count < point, f"the Ctrl-C at bytecode {point} was lost"
            assert learner.interrupts._interrupt_pending_on is None, f"left pending at bytecode {point}"
            runner.run(call)  # (the next call is not interrupted)
            installed = signal.set_wakeup_fd(their_end.fileno())
            assert installed == their_end.fileno(), f"the wakeup fd after a Ctrl-C at bytecode {point}"
            assert learner.interrupts._forward == -1, point
        assert point > 20  # (the test reached the swap's inside)
    finally:
        signal.set_wakeup_fd(outside)
        theirs.close()
        their_end.close()


def test_a_signal_that_comes_as_a_run_ends_reaches_the_program_s_own_loop_at_once() -> None:
    """A program's own loop (asyncio's, its signal handlers added: they run only as the loop reads their bytes
    from its wakeup fd) gets a signal that came as a run of ours ended, after our loop's last look at the wakeup
    socket but before the program's fd was put back: it stayed in our socket until our next run (none: never)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    theirs = asyncio.new_event_loop()
    got: list[str] = []
    theirs.add_signal_handler(signal.SIGUSR1, lambda: got.append("usr1"))
    ending = learner.interrupts.signals_wake.__exit__.__code__

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is ending:
            sys.settrace(None)
            os.kill(os.getpid(), signal.SIGUSR1)  # (its byte written before kill returns)
        return None

    async def call() -> None:
        await asyncio.sleep(0)

    try:
        sys.settrace(tracer)
        try:
            LoopRunner.for_this_thread().run(call)
        finally:
            sys.settrace(None)
        theirs.run_until_complete(asyncio.sleep(0.2))
        assert got == ["usr1"]
    finally:
        theirs.remove_signal_handler(signal.SIGUSR1)
        theirs.close()


def test_the_wakeup_socket_kept_for_the_process_s_life_is_not_reported_unclosed_as_it_ends() -> None:
    """The wakeup fd's socket pair (made at the main thread's first run, kept for the process's life) is let go of as
    the interpreter ends: under ``-X dev`` it was reported twice, "ResourceWarning: unclosed <socket.socket ...>", as
    every script that used a fleet ended."""
    script = "import asyncio; from learner.loop import LoopRunner; LoopRunner.for_this_thread().run(asyncio.sleep(0))"
    done = subprocess.run([sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_worker_s_loop_the_main_thread_ran_once_leaves_the_wakeup_bytes_to_the_main_thread() -> None:
    """A loop the main thread ran once (the close of an env a worker thread made, run here by run_or_schedule)
    watched the wakeup socket for good: run later by its own thread, it read the byte a signal wrote there to wake
    the main thread's loop, which then slept on to its wait's end (2 waits in 100 of a Ctrl-C whose C handler ran
    in another thread, beside such a loop). It now leaves the bytes where they are, and stops watching."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    made: list[LoopRunner] = []
    worker = threading.Thread(target=lambda: made.append(LoopRunner.for_this_thread()))
    worker.start()
    worker.join()
    theirs = made[0]  # (held: its loop is not a spare one)
    theirs.run_or_schedule(lambda: asyncio.sleep(0))  # (run here, in the main thread: its loop now watches)
    assert theirs.loop in learner.interrupts._watching
    wakeup = learner.interrupts._wakeup
    assert wakeup is not None
    wakeup[1].send(bytes([signal.SIGINT]))  # (as a signal's C handler writes it)
    again = threading.Thread(target=lambda: theirs.run(lambda: asyncio.sleep(0.1)))
    again.start()
    again.join()
    assert wakeup[0].recv(16) == bytes([signal.SIGINT])  # (left for the main thread's loop)
    assert theirs.loop not in learner.interrupts._watching


def _ctrl_c() -> None:
    """A Ctrl-C's KeyboardInterrupt, as a callback of the loop raises it."""
    raise KeyboardInterrupt


async def _a_later_call() -> str:
    """The call after an interrupted one (the fleet's close, say): it must run to its end."""
    await asyncio.sleep(0.01)
    return "done"


def test_a_call_interrupted_as_its_future_ends_leaves_no_stop_for_the_next_call(runner: LoopRunner) -> None:
    """A KeyboardInterrupt raised in the turn of the loop in which the call's future ended (its callback
    that stops the loop scheduled, not yet run): the next call (the fleet's close) stopped at its first
    turn, "Event loop stopped before Future completed", its task cancelled, and its servers were left
    claimed (about 1 Ctrl-C in 100 while a script stepped a fleet)."""

    async def ends_with_an_interrupt_queued() -> None:
        asyncio.get_running_loop().call_soon(_ctrl_c)  # (before the future's own callbacks)

    with pytest.raises(KeyboardInterrupt):
        runner.run(ends_with_an_interrupt_queued())
    assert runner.run(_a_later_call()) == "done"


@pytest.fixture
def heap_frozen() -> Iterator[None]:
    """The objects that exist as the test begins left out of garbage collections until it ends (``gc.freeze``): for
    tests that collect at each of hundreds of points (_interrupted_at_call), whose full collections scanned the
    worker's whole heap, which grows over a suite run (their four cases took 94 + 48 + 21 + 18 s in CI, up to 180 s in
    a Python 3.13 suite run beside others, of a 300 s timeout; with a million objects loaded first, 57 s, 3.8 s
    frozen). What each point makes is collected as before."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _interrupted_at_call(point: int, call: Callable[[], Any]) -> tuple[bool, Any]:
    """``call()`` with a Ctrl-C handled as its ``point``-th Python call (counting the call of each function, where
    CPython runs a signal's handler: at its start) begins: :func:`learner.interrupts.interrupt`, as take_ctrl_c's
    handler does, raising it at once or leaving it for the loop (or for the end of an ``interrupts_held`` block).
    Returns whether it was interrupted, and what it returned. RuntimeWarnings (Python's "coroutine ... was never
    awaited", said as a coroutine never run is collected) are errors meanwhile; those raised as an object dies,
    which Python cannot raise, fail the test here."""
    unraisable: list[str] = []
    weakref_file = _weakrefset.__file__
    calls = 0

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        # (not in a WeakSet's callbacks, run as objects die: an interrupt there is Python's "Exception ignored")
        if event == "call" and frame.f_code.co_filename != weakref_file:
            calls += 1
            if calls == point:
                learner.interrupts.interrupt()
        return None

    before, hook = sys.gettrace(), sys.unraisablehook
    interrupted, returned = False, None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        sys.unraisablehook = lambda raised: unraisable.append(f"{raised.exc_type.__name__}: {raised.exc_value}")
        # (no garbage collection while it is traced: a finalizer it ran, a generator of pytest's closed, would be
        # counted, and take the interrupt)
        gc.collect()
        gc.disable()
        try:
            sys.settrace(tracer)
            try:
                returned = call()
            except KeyboardInterrupt:
                interrupted = True
            finally:
                sys.settrace(before)
                gc.enable()
            gc.collect()  # (a task made but never scheduled, a coroutine never run, says so as it is collected)
        finally:
            sys.unraisablehook = hook
    assert unraisable == [], f"interrupted at call {point}"
    return interrupted, returned


@pytest.mark.parametrize("what", ["a coroutine", "a gather of coroutines", "a coroutine on the background loop"])
def test_a_ctrl_c_at_any_call_of_a_run_leaves_nothing_scheduled_nor_logged(
    runner: LoopRunner, what: str, heap_frozen: None
) -> None:
    """A Ctrl-C handled at each Python call in turn of one ``run`` (see _interrupted_at_call), from the one of ``run``
    itself on: whatever the point, the call is not left scheduled to run at the loop's next run, the loop logs
    nothing, and no coroutine is left never awaited. Raised inside ensure_future, after the task was made or
    scheduled but before ``_run_until_complete`` knew it, the call's coroutine was closed and its task ran at the
    next call all the same, "Task exception was never retrieved" (RuntimeError: cannot reuse already awaited
    coroutine), or was destroyed pending ("Task was destroyed but it is pending!"). Raised as ``run`` was entered,
    the coroutine its caller had made for it was never closed: "RuntimeWarning: coroutine ... was never awaited"
    on stderr (learner train's Ctrl-C, now and then); ``run`` now makes it itself, from the function it is given.
    A gather's coroutines were left so too where the gather was closed, or its task cancelled, before it began. On
    the background loop (a thread that runs a loop of its own: a notebook's), a run interrupted once its call was
    handed to the loop waits for its end, as one interrupted while it waited did."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupts are held in the main thread only")
    if what.endswith("on the background loop"):
        runner = learner.loop._background_runner()  # (the process's: its handler put back below)
    ran: list[int] = []
    logged: list[str] = []
    runner.loop.set_exception_handler(lambda _, context: logged.append(str(context.get("message"))))
    try:
        _interrupt_each_call_of_a_run(runner, what, ran, logged)
    finally:
        runner.loop.set_exception_handler(None)


def _interrupt_each_call_of_a_run(runner: LoopRunner, what: str, ran: list[int], logged: list[str]) -> None:

    async def call(point: int) -> None:
        ran.append(point)
        await asyncio.sleep(0)

    point, interrupted = 0, True
    while interrupted:  # (until a point past the run's last call: it ran whole)
        point += 1

        def attempt(at: int = point) -> None:
            if what == "a gather of coroutines":
                runner.run(lambda: learner.loop.gather(call(at), call(at)))
            else:
                runner.run(lambda: call(at))

        interrupted, _ = _interrupted_at_call(point, attempt)
        if runner._thread is None:  # (the background loop's own tasks, others' included, run on)
            assert not [t for t in asyncio.all_tasks(runner.loop) if not t.done()], point
        ran_before = list(ran)
        assert runner.run(_a_later_call()) == "done"
        assert ran == ran_before, f"the call interrupted at call {point} ran later, unseen"
        assert logged == [], f"interrupted at call {point}"
    assert point > 10  # (the test reached inside ensure_future)


def test_a_ctrl_c_at_any_call_of_create_task_leaves_no_task_unseen_nor_coroutine_unawaited(
    runner: LoopRunner, heap_frozen: None
) -> None:
    """LoopRunner.create_task (a step's exchange with its server, a reconnect) interrupted at each Python call in
    turn: the task is either returned, or never runs (cancelled before its first step); no coroutine is left
    never awaited (made by the caller, its coroutine was lost to a Ctrl-C as create_task was entered), nothing is
    logged. Then a run of the loop (the fleet's close) runs what was returned."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupts are held in the main thread only")
    ran: list[int] = []
    logged: list[str] = []
    runner.loop.set_exception_handler(lambda _, context: logged.append(str(context.get("message"))))

    async def call(point: int) -> None:
        ran.append(point)

    point, interrupted = 0, True
    while interrupted:
        point += 1

        def attempt(at: int = point) -> asyncio.Task[None]:
            return runner.create_task(lambda: call(at))

        interrupted, task = _interrupted_at_call(point, attempt)
        assert runner.run(_a_later_call()) == "done"
        assert interrupted or task.done()
        assert ran == ([] if interrupted else [point]), f"interrupted at call {point}"
        assert not [t for t in asyncio.all_tasks(runner.loop) if not t.done()], point
        assert logged == [], f"interrupted at call {point}"
        ran.clear()
    assert point > 3  # (the test reached inside the loop's create_task)


def test_a_close_scheduled_for_a_loop_that_never_runs_again_leaves_no_coroutine_never_awaited() -> None:
    """run_or_schedule from another thread while the owner runs its loop (a fleet's finalizer run by a garbage
    collection there) schedules the close for the loop's next run; where there is none (the process ends), the
    close it was given, a coroutine, was collected never awaited. A function that makes it is called only then."""
    loop = asyncio.new_event_loop()
    runner = LoopRunner(loop)
    made: list[str] = []

    async def close() -> None:
        made.append("ran")

    def make() -> Coroutine[Any, Any, None]:
        made.append("made")
        return close()

    with runner._running:  # (the owner's thread runs the loop: a call from another thread is scheduled)
        worker = threading.Thread(target=runner.run_or_schedule, args=(make,))
        worker.start()
        worker.join()
    assert made == []
    loop.close()  # (never run again)
    del runner, loop
    gc.collect()
    assert made == []


def test_an_interrupt_asked_for_as_a_call_fails_is_raised_by_that_call(runner: LoopRunner) -> None:
    """A Ctrl-C handled in the loop's last turn of a call that failed (a step whose servers the same
    Ctrl-C ended): the call raised its error, and the interrupt was left for whatever call came next."""

    async def fails_as_the_interrupt_is_asked() -> None:
        asyncio.get_running_loop().call_soon(learner.interrupts.interrupt)  # (the handler, in the last turn)
        raise ConnectionError("the server went away")

    with pytest.raises(KeyboardInterrupt):
        runner.run(fails_as_the_interrupt_is_asked())
    assert runner.run(_a_later_call()) == "done"


def test_an_interrupt_left_for_the_main_thread_s_loop_is_not_raised_by_a_worker_running_it(runner: LoopRunner) -> None:
    """A close run on the main thread's loop by another thread (a finalizer, say) leaves the main
    thread's interrupt to the main thread's next call."""
    worker_raised: list[bool] = []

    def worker() -> None:
        try:
            runner.run(asyncio.sleep(0))
            worker_raised.append(False)
        except KeyboardInterrupt:
            worker_raised.append(True)

    learner.interrupts._interrupt_pending_on = runner.loop  # (as interrupt() leaves it)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert worker_raised == [False]
        with pytest.raises(KeyboardInterrupt):
            runner.run(asyncio.sleep(0))
    finally:
        learner.interrupts._interrupt_pending_on = None


def test_a_second_interrupt_during_an_interrupted_call_s_cleanup_is_not_left_for_the_next_call(
    runner: LoopRunner,
) -> None:
    """A second Ctrl-C in the last turn of the cleanup that the first one's cancel runs: the first's
    KeyboardInterrupt stands for both; the second was left pending and cut the next call (the fleet's
    close) short at its first turn."""

    async def cleaned_up_when_cancelled() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            asyncio.get_running_loop().call_soon(learner.interrupts.interrupt)  # (the second Ctrl-C's handler)
            raise

    runner.loop.call_later(0.05, _ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cleaned_up_when_cancelled())
    assert runner.run(_a_later_call()) == "done"


def test_interrupts_held_in_nested_blocks_are_raised_once_as_the_outermost_ends() -> None:
    """An inner block cleared the outer one's held interrupt and, ending, left the rest of the outer one
    unheld. ``drop``: the outermost block's end raises nothing."""
    from learner.interrupts import interrupt, interrupts_held

    with pytest.raises(KeyboardInterrupt), interrupts_held():
        interrupt()  # (held)
        with interrupts_held():
            pass
        interrupt()  # (still held: raised once, as the outer block ends)
    with interrupts_held(drop=True):
        with interrupts_held():
            interrupt()
        interrupt()
    with interrupts_held():  # (nothing left over from the dropped one)
        pass


def test_a_breakable_block_raises_a_second_interrupt_at_once() -> None:
    """learner demo's AsyncVectorEnv is built whole (see cmd_demo), but an env that takes long to build, or
    hangs, must not keep a second Ctrl-C waiting; an unbreakable block inside it holds both."""
    from learner.interrupts import interrupt, interrupts_held

    with interrupts_held(breakable=True):
        interrupt()  # (held)
        with pytest.raises(KeyboardInterrupt):  # (raised here, at once)
            interrupt()
    # (and not again as the block ended)
    with pytest.raises(KeyboardInterrupt), interrupts_held(breakable=True):
        with interrupts_held():
            interrupt()
            interrupt()  # (held too)
        pytest.fail("not raised as the outermost block ended")
    with interrupts_held():  # (nothing left over)
        pass
