"""LoopRunner: the event loop a thread runs for RemoteVectorEnv's synchronous calls."""

from __future__ import annotations

import asyncio
import threading

from learner.loop import LoopRunner


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
