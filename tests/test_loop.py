"""LoopRunner: the event loop a thread runs for RemoteVectorEnv's synchronous calls."""

from __future__ import annotations

import asyncio
import threading

from learner.loop import LoopRunner


def test_a_finalizer_on_another_thread_leaves_the_loop_to_its_thread() -> None:
    """A RemoteVectorEnv left for the garbage collector is closed by its finalizer on whatever thread
    collects it: that thread must not run the owner's loop (the owner's next call would fail with
    "This event loop is already running"); the close waits for the owner's next call."""
    runner = LoopRunner.for_this_thread()
    ran_in: list[threading.Thread] = []

    async def close() -> None:
        ran_in.append(threading.current_thread())

    collector = threading.Thread(target=runner.run_or_schedule, args=(close(),))
    collector.start()
    collector.join()
    assert ran_in == []
    runner.run(asyncio.sleep(0.01))  # the owner's next call
    assert ran_in == [threading.current_thread()]
    # On its own thread, it runs at once.
    runner.run_or_schedule(close())
    assert ran_in == [threading.current_thread()] * 2
