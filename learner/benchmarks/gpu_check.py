"""The GPU check: ``learner train`` with the learner on CUDA, to solved and for throughput, in one script.

    python -m learner.benchmarks.gpu_check            # on a machine with a CUDA GPU
    python -m learner.benchmarks.gpu_check --quick    # smaller budgets (a minute or two)
    python -m learner.benchmarks.gpu_check --compare-cpu   # each run again with the learner on the CPU

Runs, each as ``learner train --device cuda`` in its own process:
  1. CartPole-v1 to solved (mean of the last 20 episodes >= 475) on 2 local servers x 4 envs;
  2. CartPole-v1 throughput on 16 local servers x 4 envs (64 envs);
  3. ALE/Pong-v5 throughput on 16 local servers x 4 envs (84x84x4 frames, the Nature CNN), when
     ale-py is installed, with and without ``--overlap-update``;
  4. Dict observations (tests.envs:CameraClockEnv: a camera frame, a state vector, Discrete, MultiBinary and
     MultiDiscrete keys) on 4 local servers x 4 envs with --norm-obs and --overlap-update, where run in a clone
     of the repository (its tests package importable): each key's storage, normalisation and CNN on CUDA.
With ``--compare-cpu`` each run is repeated with ``--device cpu`` (on the same host, for the ratio).
It prints, and writes to ``--out``/gpu_check.json, each run's SPS, time (to solve), and the most GPU
memory torch allocated (the JSON is written after each run). Exit status 1 when CUDA is missing or a run fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from learner.local import python_m

__all__ = ["main", "planned_runs"]


def planned_runs(
    quick: bool, atari: bool, compare_cpu: bool, dict_env: bool = False
) -> list[tuple[str, str, list[str], float]]:
    """(name, device, ``learner train`` options, timeout in seconds) of each run, in order (``dict_env``: with the
    Dict-observation run, whose env is the repository's tests.envs:CameraClockEnv)."""
    fleet16 = ["--num-servers", "16", "--envs-per-server", "4"]
    runs = [
        ("cartpole-solve", ["--env", "CartPole-v1", "--stop-at-return", "475"], 600.0),
        (
            "cartpole-64-envs",
            ["--env", "CartPole-v1", *fleet16, "--total-timesteps", "100000" if quick else "300000"],
            600.0,
        ),
    ]
    if atari:
        pong = ["--env", "ALE/Pong-v5", *fleet16, "--total-timesteps", "20000" if quick else "100000"]
        runs.append(("pong-64-envs", pong, 900.0))
        # The CNN's update on the GPU while the servers step the next rollout (learner train --overlap-update).
        runs.append(("pong-64-overlap", [*pong, "--overlap-update"], 900.0))
    if dict_env:
        camera = ["--env", "tests.envs:CameraClockEnv", "--env-kwargs", '{"multi": true, "length": 20}']
        fleet4 = ["--num-servers", "4", "--envs-per-server", "4", "--norm-obs", "--overlap-update"]
        runs.append(
            ("dict-camera-16-envs", [*camera, *fleet4, "--total-timesteps", "20000" if quick else "50000"], 600.0)
        )
    devices = ["cuda", "cpu"] if compare_cpu else ["cuda"]
    return [(name, device, options, timeout) for name, options, timeout in runs for device in devices]


def _train(name: str, device: str, out: Path, options: list[str], timeout: float) -> dict[str, Any]:
    run_dir = out / (name if device == "cuda" else f"{name}-{device}")
    learner = python_m("learner")
    cmd = [*learner, "train", "--device", device, "--run-dir", str(run_dir), "--no-progress", *options]
    print(f"$ learner {' '.join(cmd[len(learner) :])}", flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # (the run is killed; the others still run)
        error = f"did not finish within {timeout:g} s"
        return {"name": name, "device": device, "ok": False, "error": error, "wall_incl_start": timeout}
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"name": name, "device": device, "ok": False, "error": proc.stderr[-2000:], "wall_incl_start": wall}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": name, "device": device, "ok": True, "wall_incl_start": round(wall, 1), **summary}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.benchmarks.gpu_check",
        description=(__doc__ or "").split("\n")[0].replace("``", ""),
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller budgets: 100k CartPole and 20k Pong steps (else 300k, 100k)"
    )
    parser.add_argument(
        "--compare-cpu", action="store_true", help="repeat each run with the learner on the CPU (--device cpu)"
    )
    parser.add_argument(
        "--out",
        default=f"runs/gpu-check-{time.strftime('%Y%m%d-%H%M%S')}",
        metavar="DIR",
        help="where runs and gpu_check.json go (default: runs/gpu-check-<date>-<time>)",
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; runs in {out}", flush=True)
    in_a_clone = Path("tests/envs.py").is_file()  # (env-server imports --env modules from its working directory)
    runs = planned_runs(args.quick, importlib.util.find_spec("ale_py") is not None, args.compare_cpu, in_a_clone)
    results: list[dict[str, Any]] = []
    for name, device, options, timeout in runs:
        results.append(_train(name, device, out, options, timeout))
        # (after each run: a check stopped at a time limit keeps the runs it finished)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))

    print(
        f"\n{'run':<18} {'device':<6} {'ok':>3} {'steps':>9} {'steps/s':>8} {'seconds':>8} {'solved at s':>12} "
        f"{'GPU MiB':>8}"
    )
    for r in results:
        if not r["ok"]:
            last = r["error"].strip().splitlines()[-1] if r["error"].strip() else ""
            print(f"{r['name']:<18} {r['device']:<6}  no  {last}")
            continue
        solved = "-" if r.get("solved_at_seconds") is None else f"{r['solved_at_seconds']:.1f}"
        memory = "-" if r.get("cuda_max_memory_mb") is None else f"{r['cuda_max_memory_mb']:.0f}"
        rate = r["total_steps"] / r["seconds"] if r["seconds"] else 0.0  # the whole run's, not the last update's
        print(
            f"{r['name']:<18} {r['device']:<6} yes {r['total_steps']:>9,} {rate:>8,.0f} {r['seconds']:>8.1f} "
            f"{solved:>12} {memory:>8}"
        )
    print(f"results: {out / 'gpu_check.json'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
