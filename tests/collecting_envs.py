"""An env whose constructor collects garbage (``gc.collect()``) in a forked process: an async vectorization worker's
first garbage collection, at once (tests/test_fork_after_grpc.py)."""

from __future__ import annotations

import gc
import os
from typing import Any

from gymnasium.envs.classic_control.cartpole import CartPoleEnv

# (the process that imported this module: the one that builds the vector env; its workers are forks of it)
_IMPORTED_IN = os.getpid()


class CollectingCartPole(CartPoleEnv):
    def __init__(self, **kwargs: Any) -> None:
        if os.getpid() != _IMPORTED_IN:
            gc.collect()
        super().__init__(**kwargs)
