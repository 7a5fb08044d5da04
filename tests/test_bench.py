"""``learner bench`` runs every suite with a tiny budget and writes well-formed JSON, Markdown and PNG.

No speed is asserted here (these machines are noisy): the numbers come from ``learner bench`` runs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from learner.benchmarks.report import TARGETS, evaluate_targets, markdown_tables

pytestmark = pytest.mark.slow


def test_bench_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner",
            "bench",
            "--suites",
            "throughput,latency,rpc,ppo",
            "--workloads",
            "cartpole-8",
            "--rounds",
            "2",
            "--seconds",
            "0.05",
            "--latency-sizes",
            "2",
            "--latency-delay-ms",
            "1",
            "--ppo-timesteps",
            "256",
            "--ppo-rounds",
            "1",
            "--ppo-sizes",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"wrote {out / 'bench.json'}" in result.stdout

    data = json.loads((out / "bench.json").read_text())
    meta = data["meta"]
    assert meta["cpus"] >= 1 and meta["grpcio"] and meta["rounds"] == 2
    assert meta["GRPC_EXPERIMENTS"] == "-event_engine_client,-event_engine_listener"

    (cartpole,) = data["throughput"]
    assert cartpole["name"] == "cartpole-8" and cartpole["num_envs"] == 8
    kinds = {r["kind"] for r in cartpole["results"]}
    assert {"sync", "async", "sb3", "remote", "vector_entry_point"} <= kinds
    for row in cartpole["results"]:
        assert row["error"] is None, row
        assert len(row["samples"]) == 2 and all(s > 0 for s in row["samples"])
        assert row["min"] <= row["median"] <= row["max"] and row["spread"] >= 0
    assert {r["layout"] for r in cartpole["results"] if r["kind"] == "remote"} == {"2x4", "1x8"}

    (latency,) = data["latency"]
    assert latency["num_envs"] == 2 and latency["delay_ms"] == 1
    for row in latency["results"]:
        assert row["ideal"] == 2000 and 0 < row["efficiency"] < 1.5

    rpc = data["rpc"]
    names = [r["name"] for r in rpc["results"]]
    assert any("Python pipe" in n for n in names) and any("StepStream" in n for n in names)
    assert all(r["median_us"] > 0 for r in rpc["results"])
    assert set(rpc["remote_overhead_per_step_us"]) == {"tcp", "unix", "unix-grpc"}

    ppo = data["ppo"]
    assert {r["backend"] for r in ppo["results"]} == {"gym", "remote"}
    for row in ppo["results"]:
        assert row["error"] is None, row
        assert row["median"] > 0

    assert [t["target"] for t in data["targets"]] == list(TARGETS)
    for target in data["targets"]:
        assert set(target) == {"target", "best_remote", "measured", "met", "candidates"}

    markdown = (out / "bench.md").read_text()
    assert "CartPole-v1, 8 envs" in markdown and "Performance targets" in markdown

    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(out / "bench.png")).shape
    assert width > 1000 and height > 500


def test_targets_and_tables_from_hand_made_results() -> None:
    def row(name: str, kind: str, samples: list[float], layout: str = "8", vectorization: str = "sync") -> dict:
        median = sorted(samples)[len(samples) // 2]
        return {
            "name": name,
            "kind": kind,
            "layout": layout,
            "vectorization": vectorization,
            "samples": samples,
            "median": median,
            "min": min(samples),
            "max": max(samples),
            "spread": 0.1,
            "error": None,
        }

    results = {
        "throughput": [
            {
                "name": "cartpole-8",
                "title": "CartPole-v1, 8 envs",
                "results": [
                    row("AsyncVectorEnv(8)", "async", [10.0, 20.0, 10.0]),
                    row("SB3 SubprocVecEnv(8)", "sb3", [5.0, 10.0, 5.0]),
                    row("remote 2x4 unix", "remote", [16.0, 30.0, 16.0], "2x4"),
                    row("remote 2x4 unix vec", "remote", [90.0, 90.0, 90.0], "2x4", "vector_entry_point"),
                ],
            }
        ]
    }
    first, *rest = evaluate_targets(results)
    # Paired ratios (1.6, 1.5, 1.6 against async; 3.2, 3.0, 3.2 against SB3); the vec server does not count.
    assert first["best_remote"] == "remote 2x4 unix"
    assert first["measured"] == {"x AsyncVectorEnv(8)": 1.6, "x SB3 SubprocVecEnv(8)": 3.2}
    assert first["met"] is True
    assert all(t["met"] is None for t in rest)  # not run
    table = markdown_tables({**results, "targets": evaluate_targets(results)})
    assert "| remote 2x4 unix | 16 | 10% | 1.60 |" in table
    assert not math.isnan(first["measured"]["x AsyncVectorEnv(8)"])


def test_the_latency_target_is_judged_by_scaling_from_one_env_and_both_figures_are_reported() -> None:
    def latency(n: int, rows: list[tuple[str, str, float]]) -> dict:
        ideal = n / 0.002
        return {
            "num_envs": n,
            "delay_ms": 2.0,
            "results": [
                {"name": name, "kind": kind, "samples": [v], "median": v, "efficiency": v / ideal}
                for name, kind, v in rows
            ],
        }

    results = {
        "latency": [
            latency(1, [("AsyncVectorEnv(1)", "async", 450.0), ("remote 1x1 unix", "remote", 400.0)]),
            latency(64, [("AsyncVectorEnv(64)", "async", 8000.0), ("remote 2x32 unix", "remote", 24320.0)]),
        ]
    }
    target = evaluate_targets(results)[3]
    assert target["best_remote"] == "remote 2x32 unix"
    # 24,320 is 76 % of 64 / 2 ms, and 95 % of 64 x what one remote env does alone (400).
    assert target["measured"] == {"of num_envs / delay": 0.76, "of linear scaling from 1 env": 0.95}
    assert target["met"] is True
    table = markdown_tables(results)
    assert "Scaling efficiency" in table and "| 64 | 28% |  | 95% |" in table


def test_cartpole_solve_compares_the_fastest_8_env_configuration_with_the_fastest_1_env_one() -> None:
    from learner.benchmarks.cartpole_solve import eight_vs_one

    def row(solved: str, seconds: float | None) -> dict[str, object]:
        return {"solved": solved, "median_seconds": seconds}

    rows = {
        "remote-8": row("3/3", 14.0),
        "remote-8-overlap": row("3/3", 8.0),
        "remote-8-tuned": row("2/3", 6.0),  # did not solve every seed: out
        "remote-1": row("3/3", 60.0),
        "remote-1-overlap": row("3/3", 48.0),
    }
    assert eight_vs_one(rows) == {
        "eight": "remote-8-overlap",
        "eight_seconds": 8.0,
        "one": "remote-1-overlap",
        "one_seconds": 48.0,
        "ratio": 6.0,
    }
    assert eight_vs_one({"remote-8": row("3/3", 14.0)}) is None


def test_the_gpu_check_plans_each_run_on_cuda_and_with_compare_cpu_on_the_cpu_too() -> None:
    import torch

    from learner.benchmarks.gpu_check import main, planned_runs

    runs = planned_runs(quick=True, atari=True, compare_cpu=False)
    assert [name for name, *_ in runs] == ["cartpole-solve", "cartpole-64-envs", "pong-64-envs", "pong-64-overlap"]
    assert {device for _, device, *_ in runs} == {"cuda"}
    assert "--overlap-update" in runs[-1][2]
    paired = planned_runs(quick=False, atari=False, compare_cpu=True)
    assert [(name, device) for name, device, *_ in paired] == [
        ("cartpole-solve", "cuda"),
        ("cartpole-solve", "cpu"),
        ("cartpole-64-envs", "cuda"),
        ("cartpole-64-envs", "cpu"),
    ]
    assert "300000" in paired[2][2]
    if not torch.cuda.is_available():
        assert main(["--quick", "--out", "unused"]) == 1  # says so, runs nothing
