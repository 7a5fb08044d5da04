"""``learner bench`` runs every suite with a tiny budget and writes well-formed JSON, Markdown and PNG.

No speed is asserted here (these machines are noisy): the numbers come from ``learner bench`` runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from learner.benchmarks.report import PAIRED_NOTE, TARGETS, evaluate_targets, markdown_tables, plot_results
from tests.conftest import CTRL_C_EXIT, parent_of

# The reference run the README shows, and the bench.md and bench.png written from it.
COMMITTED = Path(__file__).parents[1] / "learner" / "benchmarks" / "results"
COMMITTED_JSON = COMMITTED / "bench.json"


@pytest.mark.slow
@pytest.mark.needs_torch
def test_bench_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # A MuJoCo that raises AttributeError as it is imported (without its GL libraries: MUJOCO_GL=osmesa and no
    # OSMesa), which the forkserver's preload died of: every baseline failed with EOFError, CartPole's too.
    (tmp_path / "broken" / "mujoco").mkdir(parents=True)
    (tmp_path / "broken" / "mujoco" / "__init__.py").write_text("raise AttributeError('no GL')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "broken"), os.environ.get("PYTHONPATH")) if p)
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
            "--ppo-layouts",  # (the two the PPO target compares; every layout is a `learner train` subprocess)
            "gym,unix",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": path},
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
    assert [r["name"] for r in ppo["results"]] == ["in-process SyncVectorEnv(4)", "remote 2x2 unix"]  # (--ppo-layouts)
    for row in ppo["results"]:
        assert row["error"] is None, row
        assert row["median"] > 0

    assert [t["target"] for t in data["targets"]] == list(TARGETS)
    for target in data["targets"]:
        assert set(target) == {"target", "ran", "best_remote", "measured", "met", "candidates", "not_measured"}

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
                    row("remote 2x4 unix pipelined/2", "remote", [17.0, 31.0, 17.0], "2x4"),
                ],
            }
        ]
    }
    first, *rest = evaluate_targets(results)
    # Paired ratios (1.6, 1.5, 1.6 against async; 3.2, 3.0, 3.2 against SB3); the vec server does not count,
    # and the default layout is judged, not the best of those within noise of it (reported beside).
    assert first["best_remote"] == "remote 2x4 unix"
    assert first["candidates"]["remote 2x4 unix pipelined/2"] == 1.7
    assert first["measured"] == {"x AsyncVectorEnv(8)": 1.6, "x SB3 SubprocVecEnv(8)": 3.2}
    assert first["met"] is True
    assert all(t["met"] is None for t in rest)  # not run
    table = markdown_tables({**results, "targets": evaluate_targets(results)})
    assert "| remote 2x4 unix | 16 | 10% | 1.60 |" in table
    assert not math.isnan(first["measured"]["x AsyncVectorEnv(8)"])


def _row(name: str, kind: str, samples: list[float], layout: str = "8") -> dict:
    """A throughput result row, as the bench writes one."""
    return {
        **{"name": name, "kind": kind, "layout": layout, "vectorization": "sync", "samples": samples},
        **{"median": statistics.median(samples), "min": min(samples), "max": max(samples), "spread": 0.1},
        "error": None,
    }


def test_the_ratio_column_says_it_is_the_median_of_paired_ratios_not_the_ratio_of_the_medians() -> None:
    # Per round 1.2, 1.5, 0.75 x Async: their median is 1.2, where the medians shown (30 / 20) give 1.5.
    workload = {
        "name": "cartpole-8",
        "title": "CartPole-v1, 8 envs",
        "results": [
            _row("AsyncVectorEnv(8)", "async", [10.0, 20.0, 40.0]),
            _row("SB3 SubprocVecEnv(8)", "sb3", [5.0, 10.0, 20.0]),
            _row("remote 2x4 unix", "remote", [12.0, 30.0, 30.0], "2x4"),
        ],
    }
    results = {"throughput": [workload]}
    table = markdown_tables({**results, "targets": evaluate_targets(results)})
    assert "| vector env | env-steps/s | spread | x AsyncVectorEnv (paired) |" in table
    assert "| remote 2x4 unix | 30 | 10% | 1.20 |" in table
    assert PAIRED_NOTE in table and "not the ratio of the medians shown" in PAIRED_NOTE
    # Said once, under the last throughput table, before the other suites' tables.
    two = {"throughput": [workload, {**workload, "name": "pong-8", "title": "Pong"}]}
    table = markdown_tables({**two, "targets": evaluate_targets(two)})
    assert table.count(PAIRED_NOTE) == 1 and table.index("**Pong**") < table.index(PAIRED_NOTE)
    assert table.index(PAIRED_NOTE) < table.index("**Performance targets**")


def test_a_partial_run_lists_only_the_targets_whose_workloads_ran() -> None:
    cartpole: dict[str, Any] = {
        "name": "cartpole-8",
        "title": "CartPole-v1, 8 envs",
        "results": [
            _row("AsyncVectorEnv(8)", "async", [10.0]),
            _row("SB3 SubprocVecEnv(8)", "sb3", [5.0]),
            _row("remote 2x4 unix", "remote", [16.0], "2x4"),
        ],
    }
    results = {"throughput": [cartpole]}  # --suites throughput --workloads cartpole-8
    targets = evaluate_targets(results)
    assert [t["ran"] for t in targets] == [True, False, False, False, False]
    table = markdown_tables({**results, "targets": targets})
    listed = [t for t in TARGETS for line in table.splitlines() if line.startswith(f"| {t} |")]
    assert listed == [TARGETS[0]], table
    assert "not run" not in table
    # A workload that ran with no remote figure (every remote variant failed) is listed, and says so.
    failed = {**cartpole, "results": [*cartpole["results"][:2], {**cartpole["results"][2], "samples": []}]}
    table = markdown_tables({"throughput": [failed], "targets": evaluate_targets({"throughput": [failed]})})
    assert f"| {TARGETS[0]} | - | - x AsyncVectorEnv(8), - x SB3 SubprocVecEnv(8) | no remote result |" in table
    # None ran (the latency suite without 64 envs): no table at all.
    results = {"latency": [_latency(2, 2.0, [("remote 1x2 unix", "remote", 900.0)])]}
    assert "Performance targets" not in markdown_tables({**results, "targets": evaluate_targets(results)})


def test_the_latency_target_is_judged_by_num_envs_over_the_delay_and_both_figures_are_reported() -> None:
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
    assert target["met"] is False  # (95 % of what 64 x one remote env would do: not the ideal's 85 %)
    results["latency"][1]["results"][1]["efficiency"] = 0.86
    assert evaluate_targets(results)[3]["met"] is True
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


@pytest.mark.slow
@pytest.mark.needs_torch
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
    (name, device, options, _), *_ = planned_runs(quick=True, atari=False, compare_cpu=False, dict_env=True)[2:]
    assert (name, device) == ("dict-camera-16-envs", "cuda") and "tests.envs:CameraClockEnv" in options
    if not torch.cuda.is_available():
        assert main(["--quick", "--out", "unused"]) == 1  # says so, runs nothing


def _latency(n: int, delay_ms: float, rows: list[tuple[str, str, float]]) -> dict:
    return {
        "num_envs": n,
        "delay_ms": delay_ms,
        "results": [
            {"name": name, "kind": kind, "samples": [v], "median": v, "efficiency": v / (n / delay_ms * 1000)}
            for name, kind, v in rows
        ],
    }


def _ppo(env: str, rounds: int = 3) -> dict:
    def row(name: str, backend: str, sps: float) -> dict:
        samples = [sps] * rounds
        return {
            **{"name": name, "backend": backend, "num_envs": 8, "samples": samples},
            **{"median": sps, "min": sps, "max": sps, "spread": 0.0},
        }

    return {
        "env": env,
        "total_timesteps": 100,
        "results": [row("in-process SyncVectorEnv(8)", "gym", 1000.0), row("remote 2x4 unix", "remote", 900.0)],
    }


def test_targets_stated_for_other_data_than_was_measured_are_not_judged() -> None:
    rows = [("AsyncVectorEnv(1)", "async", 180.0), ("remote 1x1 unix", "remote", 160.0)]
    results = {
        "latency": [
            _latency(1, 5.0, rows),
            _latency(64, 5.0, [("remote 2x32 unix", "remote", 12_000.0)]),
        ],
        "ppo": _ppo("Pendulum-v1"),
    }
    targets = evaluate_targets(results)
    assert targets[3]["met"] is None and targets[3]["not_measured"] == "the latency suite ran with a 5 ms step"
    assert targets[4]["met"] is None and targets[4]["not_measured"] == "the ppo suite ran Pendulum-v1"
    table = markdown_tables({**results, "targets": targets})
    assert "| not measured (the ppo suite ran Pendulum-v1) |" in table
    cartpole = evaluate_targets({"ppo": _ppo("CartPole-v1")})[4]
    assert cartpole["met"] is True and cartpole["not_measured"] is None
    # Its reference failed (no samples): not measured, not "no".
    failed = _ppo("CartPole-v1")
    failed["results"][0]["samples"] = []
    target = evaluate_targets({"ppo": failed})[4]
    assert target["met"] is None
    assert target["not_measured"] == "the in-process SyncVectorEnv(8) (gym backend) gave no figure"
    # Not asked for (--ppo-sizes without 8, --ppo-layouts without gym): nothing failed, nor is it said to have.
    for sizes, layouts in (([64], ["gym", "unix"]), ([8], ["unix"])):
        unasked = _ppo("CartPole-v1")
        del unasked["results"][0]
        config = {"ppo_sizes": sizes, "ppo_layouts": layouts}
        target = evaluate_targets({"config": config, "ppo": unasked})[4]
        assert target["met"] is None
        assert target["not_measured"] == (
            f"no 8-env run on the gym backend was asked for (--ppo-sizes {sizes[0]} --ppo-layouts {','.join(layouts)})"
        )


def test_the_report_says_when_every_figure_is_one_sample() -> None:
    results = {"meta": {"rounds": 1}, "config": {"ppo_rounds": 1}, "ppo": _ppo("CartPole-v1", rounds=1)}
    table = markdown_tables({**results, "targets": evaluate_targets(results)})
    assert "Note: --rounds and --ppo-rounds 1: each figure above is one sample" in table
    assert "| remote 2x4 unix | 900 | n/a |" in table  # (one sample: no spread, not 0 %)
    results = {"meta": {"rounds": 5}, "config": {"ppo_rounds": 3}, "ppo": _ppo("CartPole-v1")}
    assert "one sample" not in markdown_tables({**results, "targets": evaluate_targets(results)})


def test_one_round_has_no_spread_and_is_one_round_not_one_rounds() -> None:
    rpc = {"name": "gRPC unary call, empty answer (tcp)", "median_us": 550.0, "min_us": 550.0, "max_us": 550.0}
    results = {
        "meta": {"rounds": 1},
        "throughput": [
            {
                "name": "cartpole-8",
                "title": "CartPole-v1, 8 envs",
                "results": [
                    {**_row("SyncVectorEnv(8)", "sync", [41_108.0]), "spread": 0.0},
                    {**_row("AsyncVectorEnv(8)", "async", [6_000.0]), "spread": 0.0},
                ],
            }
        ],
        "rpc": {"results": [{**rpc, "samples_us": [550.0]}]},
    }
    table = markdown_tables(results)
    assert "**CartPole-v1, 8 envs** (env-steps/s, median of 1 round)" in table
    assert "| SyncVectorEnv(8) | 41,108 | n/a | 6.85 |" in table
    assert "**One round trip (microseconds, median of 1 round)**" in table
    assert "| gRPC unary call, empty answer (tcp) | 550 | n/a |" in table
    assert "0%" not in table and "1 rounds" not in table
    two = {**results, "rpc": {"results": [{**rpc, "samples_us": [550.0, 560.0], "max_us": 560.0}]}}
    assert "| gRPC unary call, empty answer (tcp) | 550 | 2% |" in markdown_tables(two)


def test_the_committed_bench_md_and_png_are_what_the_code_writes_from_the_committed_bench_json(
    tmp_path: Path,
) -> None:
    """So they cannot go stale: after a change to the report, write them again with
    ``python -m learner.benchmarks.report learner/benchmarks/results/bench.json``."""
    import matplotlib.image

    from learner.benchmarks.report import main

    assert main([str(COMMITTED_JSON), "--out", str(tmp_path)]) == 0
    assert (COMMITTED / "bench.md").read_text() == (tmp_path / "bench.md").read_text()
    # (The pixels depend on the fonts and matplotlib installed; the layout does not.)
    committed = matplotlib.image.imread(str(COMMITTED / "bench.png")).shape
    assert committed == matplotlib.image.imread(str(tmp_path / "bench.png")).shape


@pytest.mark.parametrize(
    ("content", "got"),
    [
        ('{"total_steps": 10, "solved": true}', "an object with keys 'total_steps', 'solved'"),
        ("[1, 2]", "a JSON list"),
        ("{}", "an empty object"),
    ],
)
def test_re_rendering_refuses_a_json_that_is_no_bench_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, got: str
) -> None:
    from learner.benchmarks.report import main

    path = tmp_path / "summary.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        main([str(path)])
    assert exited.value.code == 2 and not list(tmp_path.glob("bench.*"))
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"{path}: expected a bench.json of learner bench (its 'meta' and results of a suite: throughput, latency, "
            f"ppo, rpc), got {got}"
        )
    )


def _throughput(name: str, values: list[float]) -> dict:
    kinds = ["async", "sb3", "remote"]
    return {
        "name": name,
        "title": f"{name} title",
        "results": [
            {
                "name": f"{kind} {i}",
                "kind": kind,
                "samples": [v],
                "median": v,
                "min": v * 0.9,
                "max": v * 1.1,
                "error": None,
            }
            for i, (kind, v) in enumerate(zip(kinds, values, strict=False))
        ],
    }


def _figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures plot_results saves, kept for inspection."""
    from matplotlib.figure import Figure

    saved: list = []
    save = Figure.savefig

    def keep(fig: Figure, *args: Any, **kwargs: Any) -> None:
        fig.canvas.draw()
        saved.append(fig)
        save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _header(fig: Any) -> tuple[Any, list[Any]]:
    """The chart's title and legends (in its first subfigure, above the panels)."""
    header = fig.subfigs[0]
    (title,) = header.texts
    return title, list(header.legends)


@pytest.mark.parametrize("suites", ["throughput", "ppo"])
def test_a_one_column_chart_shows_its_whole_title_and_legend_and_its_budget(
    suites: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _figures(monkeypatch)
    meta = {"cpus": 2, "python": "3.11.7", "grpcio": "1.85.3", "rounds": 5, "seconds": 2.0, "load_average_start": [1.0]}
    results: dict = {"meta": meta, "config": {"ppo_rounds": 1}}
    if suites == "throughput":
        results["throughput"] = [_throughput("cartpole-8", [14_000.0, 13_000.0, 22_000.0])]
    else:
        results["ppo"] = _ppo("CartPole-v1", rounds=1)
    plot_results(results, tmp_path / "bench.png")
    (fig,) = figures
    box = fig.bbox
    title, legends = _header(fig)
    assert legends
    for artist in (title, *legends):
        extent = artist.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1, (artist, extent, box)
    text = " ".join(title.get_text().split())
    if suites == "ppo":
        assert "PPO 1 run x 100 steps" in text and "rounds" not in text, text
    else:
        assert "5 rounds x 2.0 s" in text and "PPO" not in text, text
    assert "busy" not in text


def test_bars_start_at_zero_on_a_linear_axis_each_with_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bar lengths compare as the values do (a log axis from an arbitrary value made 2,630 look twice
    2,013), and each bar says its value, inside its panel."""
    figures = _figures(monkeypatch)
    results = {
        "throughput": [
            _throughput("pong-8", [2_013.0, 1_934.0, 2_630.0]),
            _throughput("cartpole-64", [7_356.0, 8_054.0, 1_385_298.0]),
        ],
        "ppo": _ppo("CartPole-v1"),
        "rpc": {"results": [{"name": "RemoteVectorEnv(1x1).step (unix, step socket)", "median_us": 148.0}]},
    }
    plot_results(results, tmp_path / "bench.png")
    (fig,) = figures
    axes = [ax for sub in fig.subfigs[1:] for ax in sub.axes]
    assert len(axes) == 4
    for ax in axes:
        assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0, ax.get_title()
        bars = ax.patches
        values = [t.get_text() for t in ax.texts]
        assert len(values) == len(bars) >= 1, (ax.get_title(), values)
        inside = ax.get_window_extent()
        for text in ax.texts:
            assert text.get_window_extent().x1 <= inside.x1, (ax.get_title(), text.get_text())
    pong = axes[0]
    assert [t.get_text() for t in pong.texts] == ["2.01k", "1.93k", "2.63k"]
    widths = [bar.get_width() for bar in pong.patches]
    assert widths[2] / widths[0] == pytest.approx(2_630 / 2_013)


def test_the_chart_is_legible_at_readme_width_and_says_when_the_machine_was_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scaled to ~900 px (a README's width), no text is below ~7 px: at most 1100 px wide, two panels a
    row, text at least 9 pt; the warning bench.md starts with is in the chart's title too."""
    import matplotlib.image
    from matplotlib.text import Text

    from learner.benchmarks.report import load_warning

    figures = _figures(monkeypatch)
    results = json.loads(COMMITTED_JSON.read_text())
    busy = {**results["meta"], "load_average_start": [2.5, 2.0, 2.0]}
    plot_results({**results, "meta": busy}, tmp_path / "bench.png")
    (fig,) = figures
    assert matplotlib.image.imread(str(tmp_path / "bench.png")).shape[1] <= 1100
    assert all(len(sub.axes) <= 2 for sub in fig.subfigs[1:])
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    small = {(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < 8.5}
    assert not small
    title, _ = _header(fig)
    warning = load_warning(busy)
    assert warning.startswith("Warning: the machine was busy")
    assert " ".join(warning.split()) in " ".join(title.get_text().split())


def test_bench_help_gives_each_workloads_number_of_vector_envs() -> None:
    from learner.benchmarks.suites import throughput_workloads
    from learner.cli import BENCH_EPILOG

    budget = " ".join(BENCH_EPILOG.split())
    for name, workload in throughput_workloads().items():
        assert f"{name} {len(workload.variants)}" in budget, name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "gym-8,sb3-dummy-8", "--step-delay-ms", "1"], "--step-delay-ms: the SB3 configurations"),
        (["--suite", "solve", "--step-delay-ms", "2"], "(sb3-subproc-8, sb3-dummy-8) have no step delay; got 2"),
        (["--max-steps", "0"], "argument --max-steps: expected an integer >= 1, got '0'"),
        (["--seeds", "a"], "argument --seeds: expected comma-separated integers such as 1,2,3, got 'a'"),
        (["--seeds", ""], "argument --seeds: expected comma-separated integers"),
        (["--configs", ""], "--configs: got ''; expected some of remote-8,"),
        (["--configs", "remote-9"], "--configs: unknown ['remote-9']"),
    ],
)
def test_cartpole_solve_refuses_bad_options_before_running_anything(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.benchmarks import cartpole_solve

    with pytest.raises(SystemExit) as exit_info:
        cartpole_solve.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cartpole_solve_without_sb3_refuses_its_configurations_before_running_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: minutes of remote-8 runs, then the sb3 run's traceback (ModuleNotFoundError)."""
    from learner.benchmarks import cartpole_solve

    monkeypatch.setitem(sys.modules, "stable_baselines3", None)  # (as if not installed)
    with pytest.raises(SystemExit) as exit_info:
        cartpole_solve.main(["--configs", "remote-8,sb3-dummy-8", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--configs: sb3-dummy-8 need stable-baselines3" in err and "(--configs remote-8)" in err, err
    assert not (tmp_path / "out").exists()


def test_cartpole_solve_keeps_the_runs_before_one_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.benchmarks import cartpole_solve

    def compare(names, seeds, delay, out, max_steps, results):
        results["remote-8"].append({"seed": 1, "steps": 100, "seconds": 1.0, "total_steps": 100, "wall_incl_start": 2})
        raise RuntimeError("remote-1 seed 1 failed (1):\nboom")

    monkeypatch.setattr(cartpole_solve, "compare", compare)
    out = tmp_path / "out"
    assert cartpole_solve.main(["--configs", "remote-8,remote-1", "--seeds", "1", "--out", str(out)]) == 1
    data = json.loads((out / "results.json").read_text())
    assert data["results"]["remote-8"]["solved"] == "1/1" and data["results"]["remote-1"]["solved"] == "0/0"
    assert "remote-1 seed 1 failed" in data["error"]
    assert "remote-1 seed 1 failed" in capsys.readouterr().err


def test_cartpole_solve_says_when_a_configuration_sets_its_own_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.benchmarks import cartpole_solve

    monkeypatch.setattr(cartpole_solve, "compare", lambda *args: {})
    monkeypatch.setattr(cartpole_solve, "summarize", lambda names, results: {})
    monkeypatch.setattr(cartpole_solve, "print_table", lambda rows, delay: None)
    monkeypatch.setattr("learner.plot.plot_runs", lambda *args, **kwargs: tmp_path / "returns.png")
    cartpole_solve.main(["--configs", "remote-8-tuned", "--max-steps", "512", "--out", str(tmp_path / "out")])
    assert "note: remote-8-tuned trains for its own 30,000 steps (its annealing horizon), not --max-steps" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("capacity", ["--seconds", "0"], "argument --seconds: expected seconds > 0, got '0'"),
        ("capacity", ["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
        ("capacity", ["--replicas", "x"], "argument --replicas: expected comma-separated integers >= 1"),
        ("soak", ["--control", "5"], "--control: expected fewer than --servers (4), got 5"),
        ("soak", ["--servers", "1", "--control", "1"], "--control: expected fewer than --servers (1), got 1"),
        ("soak", ["--envs-per-server", "0"], "argument --envs-per-server: expected an integer >= 1, got '0'"),
        ("soak", ["--minutes", "inf"], "argument --minutes: expected a number > 0, got 'inf'"),
        ("wake", ["--samples", "0"], "argument --samples: expected an integer >= 1, got '0'"),
    ],
)
def test_the_benchmark_modules_refuse_bad_options_naming_them(
    module: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    main = importlib.import_module(f"learner.benchmarks.{module}").main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_an_rpc_only_run_reports_spread_and_overhead_and_no_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--suites rpc: its table has a spread column as the others do, the remote overhead per step (in
    bench.json only, before) is in bench.md and on stdout, and no table of targets it does not measure;
    a busy machine (load average >= its CPUs at the start, others running at the end) is warned of, at the
    start and with the tables."""
    import learner.benchmarks.run
    from learner.cli import main

    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    monkeypatch.setattr(learner.benchmarks.run, "others_running", lambda: 5.0)
    out = tmp_path / "bench"
    assert main(["bench", "--suites", "rpc", "--rounds", "2", "--seconds", "0.02", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    markdown = (out / "bench.md").read_text()
    cpus = os.cpu_count()
    busy = (
        f"Warning: the machine was busy: 1-minute load average 99.0 at the start, at least its {cpus} CPUs; 5.0 "
        f"other tasks running on average at the end, on its {cpus} CPUs"
    )
    assert markdown.startswith(busy) and busy in stdout
    assert stdout.index(f"1-minute load average 99.0 at the start, at least its {cpus} CPUs") < stdout.index("| us |")
    for text in (markdown, stdout):
        assert "**One round trip (microseconds, median of 2 rounds)**" in text and "| | us | spread |" in text
        assert "Remote overhead per step: tcp " in text and "unix-grpc " in text
        assert "Performance targets" not in text and "not run" not in text
    rows = [line for line in markdown.splitlines() if line.startswith("| RemoteVectorEnv(1x1).step")]
    assert len(rows) == 3 and all(line.endswith("% |") for line in rows), rows


def test_the_load_warning_names_when_the_machine_was_busy() -> None:
    from learner.benchmarks.report import load_warning

    meta = {"cpus": 2, "load_average_start": [1.9, 1.0, 1.0], "load_average_end": [4.2, 1.0, 1.0]}
    assert load_warning(meta) == ""  # (the end's load average counts the run's own processes: not judged)
    assert load_warning({**meta, "others_running_end": 1.2}) == (
        "Warning: the machine was busy: 1.2 other tasks running on average at the end, on its 2 CPUs; other "
        "work competed for them, so the figures may be low and their spread wide."
    )
    both = {**meta, "load_average_start": [2.5], "others_running_end": 1.0}
    assert load_warning(both, spread=False) == (
        "Warning: the machine was busy: 1-minute load average 2.5 at the start, at least its 2 CPUs; 1.0 other "
        "tasks running on average at the end, on its 2 CPUs; other work competed for them, so the figures may "
        "be low."
    )
    assert load_warning({**meta, "others_running_end": 0.4}) == "" and load_warning({}) == ""


def test_others_running_counts_a_busy_process_and_not_the_one_asking() -> None:
    """A process spinning beside the bench counts (about 1), the bench itself does not."""
    from learner.benchmarks.run import others_running

    quiet = others_running(seconds=0.3, samples=12)
    if quiet is None:
        pytest.skip("no /proc/loadavg here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        busy = others_running(seconds=0.5, samples=20)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.5, (quiet, busy)


def test_benches_started_in_the_same_second_write_to_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Both wrote to runs/bench-<time>: the second's results replaced the first's.) An --out given that
    holds a bench.json already is said to be replaced; a suite or workload named twice runs once."""
    from learner import cli
    from learner.benchmarks import run as run_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda fmt: "20261204-120000")
    monkeypatch.setattr(run_module, "check", lambda config: None)
    monkeypatch.setattr(run_module, "run_bench", lambda config, **kwargs: {"meta": {}, "config": {}})
    for _ in range(2):
        assert cli.main(["bench", "--suites", "rpc"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("learner bench: rpc -> ")]
    assert said == [
        "learner bench: rpc -> runs/bench-20261204-120000",
        "learner bench: rpc -> runs/bench-20261204-120000-2",
    ]
    configs: list[Any] = []

    def run_bench(config: Any, **kwargs: Any) -> dict[str, Any]:
        configs.append(config)
        return {"meta": {}}

    monkeypatch.setattr(run_module, "run_bench", run_bench)
    assert cli.main(["bench", "--suites", "throughput,rpc,throughput", "--workloads", "pong-8, cartpole-8,pong-8"]) == 0
    assert (configs[0].suites, configs[0].workloads) == (("throughput", "rpc"), ("pong-8", "cartpole-8"))  # (once each)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "bench.json").write_text("{}")
    assert cli.main(["bench", "--suites", "rpc", "--out", "mine"]) == 0
    assert (
        "learner bench: --out mine holds a bench.json already: this run's results replace it" in capsys.readouterr().err
    )


def test_a_ctrl_c_during_the_last_load_sample_still_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second of sampling other work at the end is part of the run: a first Ctrl-C there is the run's
    interrupt, and bench.md and bench.png are written (was: "learner bench: aborted", bench.json alone)."""
    from learner.benchmarks import run as run_module

    def interrupted() -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "_run_suites", lambda *args: None)
    monkeypatch.setattr(run_module, "others_running", interrupted)
    out = tmp_path / "bench"
    results = run_module.run_bench(run_module.BenchConfig(out=out, suites=("ppo",)), lambda line: None, checked=True)
    assert results["meta"]["interrupted"] is True and results["meta"]["others_running_end"] is None
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert json.loads((out / "bench.json").read_text())["meta"]["interrupted"] is True


@pytest.mark.slow
def test_a_bench_stopped_mid_workload_keeps_the_rounds_it_finished(tmp_path: Path) -> None:
    """Stopped in the second of five rounds of a workload, the first round's figures are kept (they
    were lost with the workload: a long Pong or HalfCheetah workload stopped near its end gave nothing)."""
    out = tmp_path / "bench"
    argv = ["--suites", "latency", "--latency-sizes", "1", "--rounds", "5", "--seconds", "1", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner", "bench", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if ": round 1/5: " in line:
                break
        else:
            pytest.fail(f"no round finished: {proc.communicate()[1][-3000:]}")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["interrupted"] is True
    (workload,) = data["latency"]
    rounds = {len(r["samples"]) for r in workload["results"]}
    assert rounds in ({1}, {2}), workload["results"]  # (round 2 may have finished before the signal came)
    assert all(r["median"] > 0 for r in workload["results"])
    assert "| 1 | " in (out / "bench.md").read_text()  # (its row of the latency table)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
@pytest.mark.needs_torch
def test_a_bench_stopped_writes_what_finished_and_leaves_no_temporary_folder(tmp_path: Path, signum: int) -> None:
    """Stopped during the ppo suite's second run (SIGTERM, or Ctrl-C: the terminal signals the whole
    process group), it stops that run, removes its temporary folders and writes the run that finished."""
    out, tmp = tmp_path / "bench", tmp_path / "tmp"
    tmp.mkdir()
    argv = ["--suites", "ppo", "--ppo-timesteps", "4096", "--ppo-rounds", "3", "--ppo-sizes", "4", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner", "bench", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=True,  # (its own process group, for the Ctrl-C)
        # A shell's background job (a CI started with `&`) has SIGINT ignored, and so would the bench, as
        # Python leaves an ignored SIGINT ignored: the default, as at a terminal, where Ctrl-C comes from.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # the first run's line, then the second run starts
            if line.startswith("PPO CartPole-v1: round 1/3: "):
                break
        else:
            pytest.fail(f"no run finished: {proc.communicate()[1][-3000:]}")
        time.sleep(1.0)
        assert any(tmp.glob("envfleet-bench-ppo-*")), "the ppo suite's runs are in a temporary folder"
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == (CTRL_C_EXIT if signum == signal.SIGINT else 130), stderr[-3000:]
    assert "learner bench: interrupted; those hold the measurements that finished" in stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["interrupted"] is True
    assert [len(r["samples"]) for r in data["ppo"]["results"]] == [1, 0, 0, 0, 0, 0], data["ppo"]["results"]
    assert (out / "bench.md").read_text().startswith("Interrupted: only the measurements that finished")
    assert "| remote 2x2 tcp | - | (not run) |" in (out / "bench.md").read_text()
    # The runs' temporary folder and their servers' sockets' are removed (torch keeps a cache there).
    assert [p.name for p in tmp.iterdir() if p.name.startswith("envfleet")] == []


@pytest.mark.needs_torch
def test_what_a_run_needs_is_checked_before_anything_is_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workload whose env cannot be built here (ALE not installed, say), or a missing matplotlib
    (bench.png) or torch (the ppo suite), was found after the measurements (~20 minutes for all)."""
    import importlib.util

    import env_server.envs
    from learner.benchmarks.run import BenchConfig, check

    config = BenchConfig(out=tmp_path / "bench", suites=("throughput", "ppo"), workloads=("cartpole-8", "pong-8"))
    build = env_server.envs.build_vector_env

    def no_ale(server_config: object, **kwargs: object) -> object:
        if getattr(server_config, "env", "").startswith("ALE/"):
            raise env_server.envs.EnvBuildError("cannot make env 'ALE/Pong-v5': NamespaceNotFound: ALE")
        return build(server_config, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(env_server.envs, "build_vector_env", no_ale)
        with pytest.raises(ValueError) as err:
            check(config)
    assert str(err.value) == (
        "--workloads: pong-8 cannot run here: cannot make env 'ALE/Pong-v5': NamespaceNotFound: ALE; install what "
        "it needs (pip install 'envfleet[bench]' brings MuJoCo, ALE and SB3) or leave it out (--workloads cartpole-8)"
    )
    find_spec = importlib.util.find_spec
    for missing in ("matplotlib", "torch"):
        with monkeypatch.context() as patch:
            patch.setattr(
                importlib.util,
                "find_spec",
                lambda name, *a, gone=missing: None if name == gone else find_spec(name, *a),
            )
            with pytest.raises(ModuleNotFoundError) as gone:
                check(config)
        assert gone.value.name == missing


def test_a_dependency_that_is_installed_but_does_not_import_is_said_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.benchmarks.run import _check_installed

    (tmp_path / "brokenmod").mkdir()
    (tmp_path / "brokenmod" / "__init__.py").write_text("raise ImportError('a broken build')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(
        ValueError, match=r"needs brokenmod, which is installed but does not import: ImportError: a broken build"
    ):
        _check_installed("brokenmod")


def test_the_wake_benchmark_times_every_wait_and_writes_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.benchmarks.wake import WAITS, main

    out = tmp_path / "wake.json"
    assert main(["--samples", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["samples"] == 3
    assert [row["wait"] for row in data["rows"]] == [label for label, _ in WAITS]
    assert all(row["median_us"] > 0 for row in data["rows"])
    assert data["rows"][0]["x_back_to_back"] == 1.0
    table = capsys.readouterr().out
    assert table.startswith("| wait before the call | median (us) | x back to back |")
    assert table.count("\n") == 2 + len(WAITS)


def _children_of(pid: int) -> list[int]:
    """The processes started with ``--parent-pid pid`` (Linux: from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"--parent-pid" in argv and argv[argv.index(b"--parent-pid") + 1 :][:1] == [str(pid).encode()]
        if ours and parent_of(int(entry.name)) == pid:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the bench's runs in /proc (Linux)")
@pytest.mark.needs_torch
def test_a_killed_bench_leaves_no_run_going_and_the_next_one_removes_its_folder(tmp_path: Path) -> None:
    """SIGKILLed (no handler of its runs), a bench's `learner train` run stops by itself (--parent-pid),
    closing its env servers and their sockets' folder, not train on to its end unseen; the folder the
    runs wrote to is removed by the next bench."""
    from learner.benchmarks.ppo import remove_orphaned_workdirs

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = ["--suites", "ppo", "--ppo-timesteps", "10000000", "--ppo-rounds", "1", "--ppo-sizes", "4"]
    argv += ["--ppo-layouts", "unix", "--out", str(tmp_path / "bench")]
    bench = subprocess.Popen(
        [sys.executable, "-m", "learner", "bench", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    run: list[int] = []
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 240  # (120 s fell short at a load average of 150: the bench, then its run)
        while True:
            assert time.monotonic() < deadline and bench.poll() is None, "the bench's run did not start"
            run = _children_of(bench.pid)
            servers = _children_of(run[0]) if run else []
            if servers:
                break
            time.sleep(0.2)
        # Training: its first update written (a fixed wait fell short on a loaded machine, the run still starting)
        while not any(p.stat().st_size for p in tmp.glob("envfleet-bench-ppo-*/remote_2x2_unix-1/metrics.jsonl")):
            assert time.monotonic() < deadline and bench.poll() is None, "the bench's run did not train"
            time.sleep(0.2)
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 60
        while _running(run[0]) or any(map(_running, servers)):
            assert time.monotonic() < deadline, "the bench's run went on after the bench was killed"
            time.sleep(0.2)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in run + servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for root in (tmp, Path("/tmp")):  # (their sockets' folder: /tmp where tmp is too long a path for sockets)
        assert not any(p.name.startswith(f"envfleet-{run[0]}-") for p in root.iterdir()), "its servers were closed"
    (workdir,) = [p for p in tmp.iterdir() if p.name.startswith(f"envfleet-bench-ppo-{bench.pid}-")]
    assert (workdir / "remote_2x2_unix-1" / "summary.json").is_file()  # (stopped as SIGTERM stops it)
    remove_orphaned_workdirs(str(tmp))  # (as the next bench does first)
    assert not workdir.exists()


def test_a_bench_whose_results_cannot_be_written_measures_on_prints_its_tables_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A disk full under --out ended the bench with a traceback at its first save, its measurements lost."""
    import errno

    import learner.benchmarks.run
    from learner.cli import main

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(learner.benchmarks.run.rundir, "write_json", full)
    monkeypatch.setattr(learner.benchmarks.run.report, "write_report", full)
    out = tmp_path / "bench"
    assert main(["bench", "--suites", "rpc", "--rounds", "2", "--seconds", "0.02", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "| us |" in captured.out and "wrote " not in captured.out
    said = f"cannot write {out / 'bench.json'}: No space left on device"
    assert captured.out.count(f"{said}; ") == 1 and "measuring on (the tables are printed at the end)" in captured.out
    assert captured.err.startswith(f"learner bench: error: {said}")
    assert f"learner bench: error: cannot write the report in {out}: No space left on device" in captured.err


def test_a_bench_interrupted_whose_results_cannot_be_written_says_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Interrupted with nothing written, it exited 130 saying only why the files were not written."""
    import errno

    import learner.benchmarks.run
    from learner.cli import main

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    measure = learner.benchmarks.run.run_bench

    def stopped(*args: Any, **kwargs: Any) -> dict[str, Any]:
        results = measure(*args, **kwargs)
        results["meta"]["interrupted"] = True  # (as a Ctrl-C during the last measurement leaves them)
        return results

    monkeypatch.setattr(learner.benchmarks.run.rundir, "write_json", full)
    monkeypatch.setattr(learner.benchmarks.run.report, "write_report", full)
    monkeypatch.setattr(learner.benchmarks.run, "run_bench", stopped)
    out = tmp_path / "bench"
    assert main(["bench", "--suites", "rpc", "--rounds", "2", "--seconds", "0.02", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"learner bench: error: cannot write the report in {out}: No space left on device" in err
    assert err.rstrip().endswith("learner bench: interrupted; the tables above hold the measurements that finished")


@pytest.mark.parametrize("script", ["capacity", "soak", "gpu_check", "cartpole_solve"])
def test_the_maintainers_benchmark_scripts_import_and_say_their_options(script: str) -> None:
    """Scripts the suite never runs (their measurements take minutes to hours, or a GPU): their imports and
    options are checked at least."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", f"learner.benchmarks.{script}", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: "), result.stderr[-2000:]


def test_a_bench_whose_default_out_cannot_be_made_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file where the runs folder goes\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--suites", "rpc", "--rounds", "2", "--seconds", "0.02"])
    assert exit_info.value.code == 2
    assert "learner bench: error: --out: cannot make runs/bench-" in capsys.readouterr().err
