"""The GPU check: ``learner train`` with the learner on CUDA, to solved and for throughput, in one script.

    python -m learner.benchmarks.gpu_check            # on a machine with a CUDA GPU
    python -m learner.benchmarks.gpu_check --quick    # smaller budgets (a minute or two)

Runs, each as ``learner train --device cuda`` in its own process:
  1. CartPole-v1 to solved (mean of the last 20 episodes >= 475) on 2 local servers x 4 envs;
  2. CartPole-v1 throughput on 16 local servers x 4 envs (64 envs);
  3. ALE/Pong-v5 throughput on 16 local servers x 4 envs (84x84x4 frames, the Nature CNN), when
     ale-py is installed, with and without ``--overlap-update``.
It prints, and writes to ``--out``/gpu_check.json, each run's SPS, time (to solve), and the most GPU
memory torch allocated. Exit status 1 when CUDA is missing or a run fails.
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

__all__ = ["main"]


def _train(name: str, out: Path, options: list[str], timeout: float) -> dict[str, Any]:
    run_dir = out / name
    cmd = [sys.executable, "-m", "learner", "train", "--device", "cuda", "--run-dir", str(run_dir), "--no-progress"]
    cmd += options
    print(f"$ {' '.join(cmd[2:])}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"name": name, "ok": False, "error": proc.stderr[-2000:], "wall_incl_start": wall}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": name, "ok": True, "wall_incl_start": round(wall, 1), **summary}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.benchmarks.gpu_check", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller throughput budgets")
    parser.add_argument(
        "--out", default=f"runs/gpu-check-{time.strftime('%Y%m%d-%H%M%S')}", help="where runs and gpu_check.json go"
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; runs in {out}", flush=True)
    fleet16 = ["--num-servers", "16", "--envs-per-server", "4"]
    runs = [
        ("cartpole-solve", ["--env", "CartPole-v1", "--stop-at-return", "475"], 600.0),
        (
            "cartpole-64-envs",
            ["--env", "CartPole-v1", *fleet16, "--total-timesteps", "100000" if args.quick else "300000"],
            600.0,
        ),
    ]
    if importlib.util.find_spec("ale_py") is not None:
        steps = "20000" if args.quick else "100000"
        pong = ["--env", "ALE/Pong-v5", *fleet16, "--total-timesteps", steps]
        runs.append(("pong-64-envs", pong, 900.0))
        # The CNN's update on the GPU while the servers step the next rollout (learner train --overlap-update).
        runs.append(("pong-64-overlap", [*pong, "--overlap-update"], 900.0))
    results = [_train(name, out, options, timeout) for name, options, timeout in runs]

    print(f"\n{'run':<18} {'ok':>3} {'steps':>9} {'SPS':>8} {'seconds':>8} {'solved at s':>12} {'GPU MiB':>8}")
    for r in results:
        if not r["ok"]:
            print(f"{r['name']:<18}  no  {r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}")
            continue
        solved = "-" if r.get("solved_at_seconds") is None else f"{r['solved_at_seconds']:.1f}"
        memory = "-" if r.get("cuda_max_memory_mb") is None else f"{r['cuda_max_memory_mb']:.0f}"
        print(
            f"{r['name']:<18} yes {r['total_steps']:>9,} {r['sps'] or 0:>8,.0f} {r['seconds']:>8.1f} {solved:>12} {memory:>8}"
        )
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out / 'gpu_check.json'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
