"""Time to solve CartPole-v1: ``learner train`` on remote envs against stable-baselines3's PPO, side by side.

"Solved" is a mean return >= 475 over the last 20 finished training episodes (CartPole-v1's
``reward_threshold``). Every configuration runs for every seed in its own fresh Python process, the
configurations interleaved seed by seed so that the machine's noise falls on all of them alike. Wall
time counts from the first reset to the solving step: it leaves out starting Python, torch, the
env servers or SB3's subprocesses (also reported, as "incl. start").

    python -m learner.benchmarks.cartpole_solve                 # remote-8 vs SB3 SubprocVecEnv(8) and DummyVecEnv(8)
    python -m learner.benchmarks.cartpole_solve --suite delay   # 8 remote envs vs 1, each env step 2 ms longer
    python -m learner.benchmarks.cartpole_solve --suite plain   # 8 remote envs vs 1, no delay
    python -m learner.benchmarks.cartpole_solve --configs remote-8,gym-8 --seeds 1,2,3,4,5

The delay and plain suites end with the fastest configuration of 8 envs against the fastest of 1
(median wall time to solve): the issue's "8 remote envs solve >= 7x faster than 1", each with its
own best settings.

SB3 runs RL Zoo's tuned CartPole-v1 PPO (hyperparams/ppo.yml: 8 envs, n_steps 32, batch 256,
20 epochs, gamma 0.98, gae_lambda 0.8, lin_0.001 learning rate, lin_0.2 clip range, ent_coef 0),
which is also ``learner train``'s ``classic`` preset. Both run torch on one CPU thread. Results go
to ``--out`` (JSON) and a plot of every run's return against steps and wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from learner.argtypes import int_list, number, positive_int
from learner.local import python_m

__all__ = ["CONFIGS", "SUITES", "main"]

THRESHOLD = 475.0
RECENT = 20


@dataclass(frozen=True)
class Config:
    """One way of training CartPole: envfleet's learner (remote or in-process envs) or SB3."""

    label: str
    kind: str  # "envfleet" or "sb3"
    num_servers: int = 2
    envs_per_server: int = 4
    backend: str = "remote"
    vec_env: str = "subproc"  # sb3: "subproc" or "dummy"
    overrides: dict[str, Any] = field(default_factory=dict)
    """``learner train`` options beyond its defaults (this layout's best hyperparameters)."""


# Each layout's best hyperparameters, found by steps to solve (--backend gym gives the same
# trajectories as remote envs, only faster) and update time. A grid over seeds 1-3 (for 1 env,
# num_steps {16, 32, 64, 128, 256} x update_epochs {10, 20}; for 8 envs, num_steps {4, 8, 16, 32} x
# {10, 20}) kept the classic preset's 32 steps per env and 20 epochs for both. A random search for 8
# envs (41 configurations of num_steps, update_epochs, num_minibatches, learning_rate, gae_lambda,
# gamma, clip_coef and the annealing horizon, seeds 1-3) then found "remote-8-tuned": 16 steps per
# env, learning rate 2e-3 annealed over 30k steps, GAE lambda 0.9; median 18.4k steps to solve on
# seeds 1-3 and 18.2k on seeds 4-8, against 24.2k for the preset, at the same update cost per env
# step. The same changes cost 1 env steps (16 steps per env: 19.7k, lambda 0.95: 28.7k, against
# 15.4k for the preset; seeds 1-3), so 1 env keeps the preset. With --overlap-update (the update runs
# while the next rollout is collected, by nets one update behind) the preset needs 45k steps with 8
# envs (seeds 1-3) but the same ~15k with 1; ~20 settings tried for 8 envs (from remote-8-tuned
# outwards: learning rate, epochs, GAE lambda, annealing horizon, clip range, steps per env) found
# "remote-8-overlap": remote-8-tuned's with learning rate 3e-3 and 10 epochs (19.4k steps on seeds
# 1-3, but 23.2k on seeds 4-6, where remote-8-tuned needs 15.7k; cheaper updates also leave the
# rollout more CPU). Decoupled PPO's objective and log-probs recomputed at the update's start, both
# against the lag, did worse (2-4 of seeds 1-6 unsolved within 30k steps). A later search (--backend gym,
# seeds 1-6, the best checked on 7-12) tried against the lag, in a throwaway patch: the actor taking the
# updated nets mid-rollout at a fixed step, waiting there for the update (deterministic; step 8 of 16
# halves the lag, step 0 gives exactly the run without the overlap), at step 4, 8 or 12 with learning rate
# 2e-3 or 3e-3 and 10-20 epochs (medians 20.0k-25.8k steps on seeds 1-6, or unsolved; at step 8 with
# remote-8-tuned's settings 19.5k over seeds 1-12, 3 unsolved); the rollout's values (GAE's baselines and
# targets) recomputed at its end by the newer critic, with or without that swap (17.7k-26.8k); a
# KL-targeted early stop at 0.01 or 0.02 (20.6k-28.8k); no clip annealing (18.9k, 24.3k); and a random
# search of 20 settings of the swap (8-16 steps per env, swap at the middle or later, learning rate
# 1.5e-3-4e-3, 10-20 epochs, lambda 0.85-0.95, gamma 0.98-0.99, clip range 0.2-0.3 annealed or not,
# horizon 25k-40k, revalued or not; 17.1k-31.5k, 4 unsolved on half the seeds). Steps to solve swing by
# +-5k between seeds and between settings a little apart (any change reroutes a run), so 3 seeds' medians
# of 15.7k-16.7k were chance: on seeds 7-12 the same settings needed 21.6k-24.6k (a seed unsolved each).
# The closest over seeds 1-12 (18.5k, 1 unsolved: 8 steps per env, swap at step 4, 20 epochs, learning
# rate 1.5e-3, lambda 0.85, 25k horizon; 21.5k on 7-12) waits at its swap for an update (20-40 ms here)
# longer than its 4 steps (~12 ms with 2 ms steps). Without any lag remote-8-tuned itself needs 17.9k over
# seeds 1-12 (17.6k on 7-12), and remote-8-overlap 25.0k (3 of seeds 7-12 unsolved within 30k): <= 17k
# with 8 envs asks for more than removing the lag. The "remote-1x8-" ones are the same settings on one
# server of 8 envs: one round trip per step instead of two, and one server process fewer on the learner's
# cores (same trajectories without the overlap).
# 8 envs' best settings (above), whatever the layout: 2 servers x 4 envs or 1 x 8.
TUNED_8: dict[str, Any] = {"num_steps": 16, "learning_rate": 2e-3, "total_timesteps": 30_000, "gae_lambda": 0.9}
OVERLAP_8: dict[str, Any] = {**TUNED_8, "overlap_update": True, "learning_rate": 3e-3, "update_epochs": 10}

CONFIGS: dict[str, Config] = {
    "remote-8": Config("envfleet, 2 local servers x 4 envs", "envfleet"),
    "remote-8-pipelined": Config("envfleet, 2 x 4, --pipeline-groups 2", "envfleet", overrides={"pipeline_groups": 2}),
    "remote-8-tuned": Config("envfleet, 2 x 4, tuned for 8 envs", "envfleet", overrides=TUNED_8),
    "remote-8-overlap": Config("envfleet, 2 x 4, --overlap-update, tuned", "envfleet", overrides=OVERLAP_8),
    "remote-1x8-tuned": Config("envfleet, 1 x 8, tuned for 8 envs", "envfleet", 1, 8, overrides=TUNED_8),
    "remote-1x8-overlap": Config("envfleet, 1 x 8, --overlap-update, tuned", "envfleet", 1, 8, overrides=OVERLAP_8),
    "remote-1": Config("envfleet, 1 local server x 1 env", "envfleet", 1, 1),
    "remote-1-overlap": Config(
        "envfleet, 1 x 1, --overlap-update", "envfleet", 1, 1, overrides={"overlap_update": True}
    ),
    "gym-8": Config("envfleet, in-process SyncVectorEnv(8)", "envfleet", 2, 4, backend="gym"),
    "sb3-subproc-8": Config("SB3 PPO, SubprocVecEnv(8)", "sb3", vec_env="subproc"),
    "sb3-dummy-8": Config("SB3 PPO, DummyVecEnv(8)", "sb3", vec_env="dummy"),
}

SUITES: dict[str, tuple[list[str], float]] = {
    "solve": (["remote-8", "sb3-subproc-8", "sb3-dummy-8", "remote-8-pipelined"], 0.0),
    "delay": (
        ["remote-8", "remote-8-tuned", "remote-8-overlap", "remote-1x8-overlap", "remote-1", "remote-1-overlap"],
        2.0,
    ),
    "plain": (
        ["remote-8", "remote-8-tuned", "remote-8-overlap", "remote-1x8-overlap", "remote-1", "remote-1-overlap"],
        0.0,
    ),
}


# -- one run (in its own process) --------------------------------------------------------------------------


def run_envfleet(config: Config, seed: int, step_delay_ms: float, run_dir: Path, max_steps: int) -> dict[str, Any]:
    from learner.config import Args
    from learner.train import train

    settings: dict[str, Any] = {
        "env": "CartPole-v1",
        "backend": "gym" if config.backend == "gym" else "remote",
        "num_servers": config.num_servers,
        "envs_per_server": config.envs_per_server,
        "step_delay_ms": step_delay_ms,
        "seed": seed,
        "total_timesteps": max_steps,  # (also the annealing horizon, unless the config sets its own)
        "stop_at_return": THRESHOLD,
        "run_dir": str(run_dir),
        "device": "cpu",
        "progress": False,
        "plot": False,
        "checkpoint_every": 0,
    }
    args = Args(**{**settings, **config.overrides})
    summary = train(args)
    return {
        "steps": summary["solved_at_step"],
        "seconds": summary["solved_at_seconds"],
        "total_steps": summary["total_steps"],
    }


def run_sb3(config: Config, seed: int, step_delay_ms: float, run_dir: Path, max_steps: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    from learner import rundir

    if step_delay_ms:
        raise ValueError("--step-delay-ms: the SB3 configurations have no step delay")
    torch.set_num_threads(1)
    run_dir.mkdir(parents=True, exist_ok=True)
    vec_cls = SubprocVecEnv if config.vec_env == "subproc" else DummyVecEnv
    envs = make_vec_env("CartPole-v1", n_envs=8, seed=seed, vec_env_cls=vec_cls)

    class StopAtReturn(BaseCallback):
        """Stops at a mean return >= THRESHOLD over the last 20 episodes; writes metrics.jsonl like ``learner train``."""

        def __init__(self) -> None:
            super().__init__()
            self.returns: list[float] = []
            self.start = 0.0
            self.solved: tuple[int, float] | None = None
            self.metrics = open(run_dir / rundir.METRICS, "w")  # noqa: SIM115 (closed in _on_training_end)

        def _on_training_start(self) -> None:
            self.start = time.perf_counter()

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns = [*self.returns[-(RECENT - 1) :], float(info["episode"]["r"])]
                    if len(self.returns) == RECENT and np.mean(self.returns) >= THRESHOLD:
                        self.solved = (self.num_timesteps, time.perf_counter() - self.start)
                        return False
            return True

        def _on_rollout_end(self) -> None:
            row = {
                "global_step": self.num_timesteps,
                "seconds": time.perf_counter() - self.start,
                "episodic_return_mean": float(np.mean(self.returns)) if self.returns else None,
            }
            rundir.append_jsonl(self.metrics, row)

        def _on_training_end(self) -> None:
            self.metrics.close()

    callback = StopAtReturn()
    model = PPO(
        "MlpPolicy",
        envs,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=lambda progress: 1e-3 * progress,
        clip_range=lambda progress: 0.2 * progress,
        seed=seed,
        device="cpu",
    )
    model.set_logger(Logger(folder=None, output_formats=[]))  # (SB3's own makes an empty /tmp/SB3-<time> folder)
    model.learn(total_timesteps=max_steps, callback=callback)
    envs.close()
    steps, seconds = callback.solved if callback.solved else (None, None)
    rundir.write_json(
        run_dir / rundir.SUMMARY,
        {
            "total_steps": model.num_timesteps,
            "seconds": time.perf_counter() - callback.start,
            "final_return_mean": float(np.mean(callback.returns)) if callback.returns else None,
            "solved": callback.solved is not None,
            "solved_at_step": steps,
            "solved_at_seconds": seconds,
        },
    )
    rundir.write_json(run_dir / rundir.CONFIG, {"args": {"env": "CartPole-v1"}, "solved_threshold": THRESHOLD})
    return {"steps": steps, "seconds": seconds, "total_steps": model.num_timesteps}


def run_one(name: str, seed: int, step_delay_ms: float, run_dir: Path, max_steps: int) -> dict[str, Any]:
    config = CONFIGS[name]
    run = run_envfleet if config.kind == "envfleet" else run_sb3
    return run(config, seed, step_delay_ms, run_dir, max_steps)


# -- the comparison ----------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def compare(
    names: Sequence[str],
    seeds: Sequence[int],
    step_delay_ms: float,
    out_dir: Path,
    max_steps: int,
    results: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Run every configuration for every seed (each in a fresh process); returns the rows.

    Each run's result goes into ``results`` (by configuration) as it ends, so that a caller keeps
    the runs before one that failed (RuntimeError)."""
    results = {name: [] for name in names} if results is None else results
    for seed in seeds:
        for name in names:
            run_dir = out_dir / f"{name}-seed{seed}"
            cmd = python_m(__spec__.name if __spec__ else "learner.benchmarks.cartpole_solve")
            cmd += ["--one", name, "--seed", str(seed), "--step-delay-ms", str(step_delay_ms)]
            cmd += ["--run-dir", str(run_dir), "--max-steps", str(max_steps)]
            started = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - started
            if proc.returncode != 0:
                raise RuntimeError(f"{name} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            result.update(seed=seed, wall_incl_start=wall, run_dir=str(run_dir))
            results[name].append(result)
            print(
                f"  {name:<14} seed {seed}: "
                + (
                    f"solved at {result['steps']:>7,} steps, {result['seconds']:6.1f} s ({wall:5.1f} s incl. start)"
                    if result["steps"] is not None
                    else f"not solved in {result['total_steps']:,} steps ({wall:.1f} s)"
                ),
                flush=True,
            )
    return summarize(names, results)


def summarize(names: Sequence[str], results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: seeds solved, medians of steps and seconds to solve, and every run."""
    rows = {}
    for name in names:
        solved = [r for r in results[name] if r["steps"] is not None]
        rows[name] = {
            "label": CONFIGS[name].label,
            "overrides": CONFIGS[name].overrides,
            "solved": f"{len(solved)}/{len(results[name])}",
            "median_steps": _median([r["steps"] for r in solved]),
            "median_seconds": _median([r["seconds"] for r in solved]),
            "median_seconds_incl_start": _median([r["wall_incl_start"] for r in solved]),
            "runs": results[name],
        }
    return rows


def eight_vs_one(rows: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest configuration with 8 envs against the fastest with 1 (median wall time to solve,
    configurations that solved every seed), or None when the rows lack one of them."""
    best: dict[int, tuple[float, str]] = {}
    for name, row in rows.items():
        config = CONFIGS[name]
        num_envs = config.num_servers * config.envs_per_server if config.kind == "envfleet" else 8
        solved, runs = (int(n) for n in row["solved"].split("/"))
        seconds = row["median_seconds"]
        if seconds is None or solved < runs or num_envs not in (1, 8):
            continue
        if num_envs not in best or seconds < best[num_envs][0]:
            best[num_envs] = (seconds, name)
    if 1 not in best or 8 not in best:
        return None
    (eight_seconds, eight), (one_seconds, one) = best[8], best[1]
    return {
        "eight": eight,
        "eight_seconds": eight_seconds,
        "one": one,
        "one_seconds": one_seconds,
        "ratio": one_seconds / eight_seconds,
    }


def print_table(rows: dict[str, Any], step_delay_ms: float) -> None:
    print(f"\nCartPole-v1 to a mean return >= {THRESHOLD:g} (last {RECENT} episodes), step delay {step_delay_ms:g} ms")
    print(f"{'configuration':<40} {'solved':>6} {'median steps':>13} {'median s':>9} {'incl. start':>12}")
    for row in rows.values():
        print(
            f"{row['label']:<40} {row['solved']:>6} {_fmt(row['median_steps'], ',.0f'):>13} "
            f"{_fmt(row['median_seconds'], '.1f'):>9} {_fmt(row['median_seconds_incl_start'], '.1f'):>12}"
        )
    speedup = eight_vs_one(rows)
    if speedup is not None:
        print(
            f"fastest with 8 envs: {speedup['eight']} ({speedup['eight_seconds']:.1f} s); with 1 env: "
            f"{speedup['one']} ({speedup['one_seconds']:.1f} s): 8 envs solve {speedup['ratio']:.2f}x faster"
        )
    names = list(rows)
    base = rows[names[0]]["median_seconds"]
    for other in names[1:]:
        theirs = rows[other]["median_seconds"]
        if base and theirs:
            print(
                f"median wall time {names[0]} / {other}: {base / theirs:.2f}  ({other} / {names[0]}: {theirs / base:.2f})"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.benchmarks.cartpole_solve",
        description=(__doc__ or "").split("\n\n")[0].replace("``", ""),  # (plain text, not RST)
        epilog="configurations: " + ", ".join(f"{k} ({v.label})" for k, v in CONFIGS.items()),
    )
    parser.add_argument(
        "--suite",
        choices=list(SUITES),
        default="solve",
        help="; ".join(f"{k}: {', '.join(names)}, step delay {delay:g} ms" for k, (names, delay) in SUITES.items())
        + " (default: %(default)s)",
    )
    parser.add_argument(
        "--configs", default=None, metavar="NAMES", help="comma-separated configurations instead of a suite's"
    )
    parser.add_argument(
        "--seeds",
        type=int_list(example="1,2,3"),
        default=[1, 2, 3],
        metavar="N,N",
        help="comma-separated seeds (default: 1,2,3)",
    )
    parser.add_argument(
        "--step-delay-ms",
        type=number(0, unit="milliseconds"),
        default=None,
        metavar="MS",
        help="ms added to every env step (default: the suite's; the SB3 configurations take none)",
    )
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        default=100_000,
        metavar="N",
        help="give up after this many steps, unless a configuration sets its own (remote-8-tuned, "
        "remote-8-overlap: 30,000, their annealing horizon) (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="directory for results.json, returns.png and the runs (default: runs/bench-cartpole-<suite>-<time>)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one is not None:  # a single run, in the process the comparison started for it
        delay = args.step_delay_ms or 0.0
        result = run_one(args.one, args.seed, delay, Path(args.run_dir), args.max_steps)
        print(json.dumps(result))
        return 0

    names, delay = SUITES[args.suite]
    if args.configs is not None:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown or not names:
            what = f"unknown {unknown}" if unknown else f"got {args.configs!r}"
            parser.error(f"--configs: {what}; expected some of {', '.join(CONFIGS)}")
    if args.step_delay_ms is not None:
        delay = args.step_delay_ms
    sb3 = [n for n in names if CONFIGS[n].kind == "sb3"]
    if delay and sb3:
        parser.error(f"--step-delay-ms: the SB3 configurations ({', '.join(sb3)}) have no step delay; got {delay:g}")
    if sb3 and importlib.util.find_spec("stable_baselines3") is None:  # (said now, not after minutes of runs)
        others = [n for n in names if n not in sb3]
        parser.error(
            f"--configs: {', '.join(sb3)} need stable-baselines3, which is not installed here: pip install "
            "'envfleet[sb3]' (from a clone: pip install -e '.[sb3]')"
            + (f", or leave them out (--configs {','.join(others)})" if others else "")
        )
    seeds = args.seeds
    out = Path(args.out or f"runs/bench-cartpole-{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out: cannot make {out}: {err.strerror or err}")
    print(
        f"CartPole-v1 to solved: {', '.join(names)}; seeds {seeds}; step delay {delay:g} ms; runs in {out}", flush=True
    )
    for name in names:
        own = CONFIGS[name].overrides.get("total_timesteps")
        if own is not None and own != args.max_steps:
            print(f"note: {name} trains for its own {own:,} steps (its annealing horizon), not --max-steps", flush=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    error = None
    try:
        compare(names, seeds, delay, out, args.max_steps, results)
    except RuntimeError as err:
        error = str(err)
    rows = summarize(names, results)
    print_table(rows, delay)
    report = {"step_delay_ms": delay, "seeds": seeds, "results": rows, "eight_vs_one": eight_vs_one(rows)}
    if error is not None:
        report["error"] = error
    (out / "results.json").write_text(json.dumps(report, indent=2))
    if error is not None:
        print(f"{parser.prog}: error: {error}\nresults so far: {out / 'results.json'}", file=sys.stderr)
        return 1

    from learner.plot import plot_runs

    runs = [(Path(r["run_dir"]), row["label"]) for row in rows.values() for r in row["runs"]]
    plot = plot_runs(
        [run for run, _ in runs],
        out / "returns.png",
        title=f"CartPole-v1 to solved, seeds {', '.join(map(str, seeds))}, step delay {delay:g} ms",
        groups=[label for _, label in runs],
    )
    print(f"results: {out / 'results.json'}; plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
