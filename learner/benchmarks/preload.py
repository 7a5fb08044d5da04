"""What the bench's forkserver imports once, beyond numpy and gymnasium (see
:func:`learner.benchmarks.throughput.prepare_subprocesses`): SB3's SubprocVecEnv, ale-py and MuJoCo, each where it
imports. multiprocessing's own preload skips a module that raises ImportError only: MuJoCo without its GL libraries
(``MUJOCO_GL=osmesa`` on a host with no OSMesa) raises AttributeError, and the forkserver died of it, every baseline
of every workload then failing with EOFError. One that fails here is left to the workload that needs it, whose
envs then say why."""

import contextlib
import importlib

for _name in ("stable_baselines3.common.vec_env.subproc_vec_env", "ale_py", "mujoco"):
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
