"""The benchmark's outputs: the performance targets checked, a Markdown table, and a PNG chart.

Run on its own, it writes bench.md and bench.png again from a bench.json, as ``learner bench`` would now
(after a change to the report; the measurements are not re)::

    python -m learner.benchmarks.report learner/benchmarks/results/bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from learner import rundir

__all__ = [
    "TARGETS",
    "evaluate_targets",
    "latency_scaling",
    "load_warning",
    "main",
    "markdown_tables",
    "plot_results",
    "write_report",
]

# What the latency and PPO targets are stated for; a run measuring something else does not judge them.
_TARGET_DELAY_MS = 2.0
_TARGET_PPO_ENV = "CartPole-v1"

# The performance targets (set when the project began): (workload, what is compared, threshold).
DEFAULT_2X4 = "remote 2x4 unix"
"""CartPole-8's target layout: 2 servers x 4 envs as ``learner train`` steps them by default."""

TARGETS = (
    "CartPole-v1, 8 envs: remote 2x4 >= 1.5 x AsyncVectorEnv(8) and >= 2 x SB3 SubprocVecEnv(8)",
    "CartPole-v1, 64 envs: remote 2x32 >= 4 x AsyncVectorEnv(64)",
    "ALE/Pong-v5, 8 envs: remote >= 1.0 x AsyncVectorEnv(8)",
    "latency-bound env, 2 ms per step, 64 envs: >= 85 % of ideal linear scaling",
    "PPO SPS, CartPole, 8 remote envs: >= 0.8 x the same PPO on an in-process SyncVectorEnv",
)


PAIRED_COLUMN = "x AsyncVectorEnv (paired)"
PAIRED_NOTE = (
    f"{PAIRED_COLUMN}: the median over rounds of each round's ratio to AsyncVectorEnv (both stepped in the "
    "same round, so load that drifts hits both alike), not the ratio of the medians shown, which can differ "
    "from it (more so the wider the spreads)."
)
"""The throughput tables' ratio column, and the line under them that says what it is."""


def _by_name(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in workload["results"]}


def _paired(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median over rounds of a's samples over b's in the same round."""
    pairs = [x / y for x, y in zip(a.get("samples") or [], b.get("samples") or [], strict=False) if y]
    return statistics.median(pairs) if pairs else math.nan


def _best_ratio(
    workload: dict[str, Any] | None, candidates: list[str], reference: str
) -> tuple[str | None, float, dict[str, float]]:
    """The candidate with the highest paired ratio to ``reference``; all candidates' ratios."""
    if workload is None:
        return None, math.nan, {}
    rows = _by_name(workload)
    ref = rows.get(reference)
    ratios = {c: _paired(rows[c], ref) for c in candidates if c in rows and ref is not None and rows[c]["samples"]}
    if not ratios:
        return None, math.nan, {}
    best = max(ratios, key=lambda c: ratios[c])
    return best, ratios[best], ratios


def _remote_names(workload: dict[str, Any] | None, layout: str | None = None) -> list[str]:
    if workload is None:
        return []
    return [
        r["name"]
        for r in workload["results"]
        if r["kind"] == "remote" and (layout is None or r["layout"] == layout) and r["vectorization"] == "sync"
    ]


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: the measured ratio (best remote layout allowed), and whether it is met.

    Only remote variants that step the same env code as the baselines count (servers with
    ``--vectorization sync``); the others are reported beside.
    """
    workloads = {w["name"]: w for w in results.get("throughput", [])}
    out: list[dict[str, Any]] = []

    w = workloads.get("cartpole-8")
    _, _, ratios = _best_ratio(w, _remote_names(w, "2x4"), "AsyncVectorEnv(8)")
    # Judged on the layout learner train steps by default, chosen before the run: the best of several
    # layouts within noise of each other, picked from the same rounds it is reported from, would read
    # a few percent high. The others are reported beside (candidates).
    best = DEFAULT_2X4 if DEFAULT_2X4 in ratios else None
    vs_async = ratios[best] if best else math.nan
    vs_sb3 = _paired(_by_name(w)[best], _by_name(w)["SB3 SubprocVecEnv(8)"]) if w and best else math.nan
    out.append(
        _target(
            TARGETS[0],
            best,
            {"x AsyncVectorEnv(8)": vs_async, "x SB3 SubprocVecEnv(8)": vs_sb3},
            vs_async >= 1.5 and vs_sb3 >= 2.0,
            ratios,
            ran=w is not None,
        )
    )

    w = workloads.get("cartpole-64")
    best, ratio, ratios = _best_ratio(w, _remote_names(w, "2x32"), "AsyncVectorEnv(64)")
    out.append(_target(TARGETS[1], best, {"x AsyncVectorEnv(64)": ratio}, ratio >= 4.0, ratios, ran=w is not None))

    w = workloads.get("pong-8")
    best, ratio, ratios = _best_ratio(w, _remote_names(w), "AsyncVectorEnv(8)")
    out.append(_target(TARGETS[2], best, {"x AsyncVectorEnv(8)": ratio}, ratio >= 1.0, ratios, ran=w is not None))

    latency = {w["num_envs"]: w for w in results.get("latency", [])}
    w = latency.get(64)
    if w is not None and w["delay_ms"] != _TARGET_DELAY_MS:
        out.append(_not_measured(TARGETS[3], f"the latency suite ran with a {w['delay_ms']:g} ms step"))
    else:
        effs = {
            r["name"]: r["efficiency"]
            for r in (w["results"] if w else [])
            if r["kind"] == "remote" and r["samples"] and r.get("efficiency") is not None
        }
        best_eff = max(effs, key=lambda n: effs[n]) if effs else None
        eff = effs[best_eff] if best_eff else math.nan
        # Linear scaling: N envs do N times what one env does on its own (the same kind of vector env).
        scaling = latency_scaling(results).get(64, {}).get(best_eff or "", math.nan)
        measured = {"of num_envs / delay": eff, "of linear scaling from 1 env": scaling}
        # Judged against num_envs / delay, the ideal the suite defines: the scaling from one env (shown
        # beside) starts from a 1x1 server that already loses ~20 % to its round trip, unpipelined, in
        # rounds run minutes apart, and passes 100 % where the 64 envs are pipelined.
        met = eff >= 0.85
        out.append(_target(TARGETS[3], best_eff, measured, met, effs, ran=w is not None))

    ppo = results.get("ppo")
    if ppo and ppo["env"] != _TARGET_PPO_ENV:
        out.append(_not_measured(TARGETS[4], f"the ppo suite ran {ppo['env']}"))
    elif ppo:
        rows = {r["name"]: r for r in ppo["results"]}
        ref = next((r for r in ppo["results"] if r["backend"] == "gym" and r["num_envs"] == 8), None)
        cands = [r["name"] for r in ppo["results"] if r["backend"] == "remote" and r["num_envs"] == 8]
        config = results.get("config", {})
        sizes, layouts = config.get("ppo_sizes", [8]), config.get("ppo_layouts", ["gym"])
        if ref is None and (8 not in sizes or "gym" not in layouts):  # (not asked for: nothing failed)
            out.append(
                _not_measured(
                    TARGETS[4],
                    f"no 8-env run on the gym backend was asked for (--ppo-sizes {','.join(map(str, sizes))} "
                    f"--ppo-layouts {','.join(layouts)})",
                )
            )
            return out
        if ref is None or not ref["samples"]:  # (its runs failed: no reference to judge the remote ones by)
            out.append(_not_measured(TARGETS[4], "the in-process SyncVectorEnv(8) (gym backend) gave no figure"))
            return out
        ratios = {c: _paired(rows[c], ref) for c in cands if rows[c]["samples"]}
        best = max(ratios, key=lambda c: ratios[c]) if ratios else None
        ratio = ratios[best] if best else math.nan
        out.append(_target(TARGETS[4], best, {"x SyncVectorEnv (gym backend)": ratio}, ratio >= 0.8, ratios))
    else:
        out.append(_target(TARGETS[4], None, {}, False, {}, ran=False))
    return out


def latency_scaling(results: dict[str, Any]) -> dict[int, dict[str, float]]:
    """For each latency-bound size N and vector env: env-steps/s / (N x what one env of the same kind
    does alone: AsyncVectorEnv(1), or the 1x1 server for every remote layout), the usual scaling
    efficiency (needs the 1-env workload; not paired by round); by N, then by name."""
    latency = {w["num_envs"]: w for w in results.get("latency", [])}
    single = latency.get(1)
    if single is None:
        return {}
    base = {r["kind"]: r["median"] for r in single["results"] if r["samples"] and r["median"]}
    return {
        n: {
            r["name"]: r["median"] / (n * base[r["kind"]])
            for r in w["results"]
            if r["samples"] and r["median"] and r["kind"] in base
        }
        for n, w in latency.items()
    }


def _target(
    target: str,
    best: str | None,
    measured: dict[str, float],
    met: bool,
    candidates: dict[str, float],
    *,
    ran: bool = True,
) -> dict[str, Any]:
    """One target's entry; ``ran``: whether the workload it is stated for ran (met is None, and the
    report leaves it out, where not; met is None too where it ran but no remote variant gave a figure)."""
    return {
        "target": target,
        "ran": ran,
        "best_remote": best,
        "measured": {k: None if math.isnan(v) else round(v, 3) for k, v in measured.items()},
        "met": bool(met) if best is not None else None,
        "candidates": {k: None if math.isnan(v) else round(v, 3) for k, v in candidates.items()},
        "not_measured": None,
    }


def _not_measured(target: str, why: str) -> dict[str, Any]:
    """A target whose suite ran, but not on what the target names (another env, another delay)."""
    return {**_target(target, None, {}, False, {}), "not_measured": why}


def load_warning(meta: dict[str, Any], spread: bool = True) -> str:
    """A warning when other work competed for the CPUs: the 1-minute load average at the start (before
    the run's own processes) was at least the CPU count, or at the end, once the run's own processes
    had ended, other tasks kept at least half of the CPUs busy (``others_running_end``; the load
    average at the end is not judged: it counts the run's own last minute). "" otherwise. ``spread``:
    the figures have one (several rounds), which the load widens."""
    cpus = meta.get("cpus")
    if not cpus:
        return ""
    busy = []
    start = meta.get("load_average_start")
    if start and start[0] >= cpus:
        busy.append(f"1-minute load average {start[0]:.1f} at the start, at least its {cpus} CPUs")
    others = meta.get("others_running_end")
    if others is not None and others >= cpus / 2:
        busy.append(f"{others:.1f} other tasks running on average at the end, on its {cpus} CPUs")
    if not busy:
        return ""
    return (
        f"Warning: the machine was busy: {'; '.join(busy)}; other work competed for them, so the figures may "
        f"be low{' and their spread wide' if spread else ''}."
    )


def markdown_tables(results: dict[str, Any]) -> str:
    """The results as Markdown (for the README and the terminal)."""
    lines: list[str] = []
    if results.get("meta", {}).get("interrupted"):
        lines += ["Interrupted: only the measurements that finished before the bench was stopped are here.", ""]
    warning = load_warning(results.get("meta", {}))
    if warning:
        lines += [warning, ""]
    for w in results.get("throughput", []):
        rows = _by_name(w)
        ref_name = next((n for n in rows if n.startswith("AsyncVectorEnv")), None)
        rounds = max(len(r["samples"] or []) for r in w["results"])  # (a variant that could not run has none)
        lines += [f"**{w['title']}** (env-steps/s, median of {_rounds(rounds)})", ""]
        lines += [f"| vector env | env-steps/s | spread | {PAIRED_COLUMN} |", "|---|---:|---:|---:|"]
        for r in w["results"]:
            if not r["samples"]:
                lines.append(f"| {r['name']} | - | - | - ({r['error']}) |")
                continue
            ratio = _paired(r, rows[ref_name]) if ref_name else math.nan
            lines.append(f"| {r['name']} | {r['median']:,.0f} | {_spread(r)} | {ratio:.2f} |")
        lines.append("")
    if results.get("throughput"):
        lines += [PAIRED_NOTE, ""]
    if results.get("latency"):
        delay = results["latency"][0]["delay_ms"]
        lines += [
            f"**Latency-bound CartPole ({delay:g} ms per step): efficiency = env-steps/s / (num_envs / delay)**",
            "",
        ]
        names = sorted({_family(r["name"]) for w in results["latency"] for r in w["results"]})
        lines += ["| num_envs | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for w in results["latency"]:
            cells = {_family(r["name"]): r for r in w["results"]}
            row = [
                f"{cells[n]['efficiency']:.0%}" if n in cells and cells[n].get("efficiency") is not None else ""
                for n in names
            ]
            lines.append(f"| {w['num_envs']} | " + " | ".join(row) + " |")
        lines.append("")
        scaling = latency_scaling(results)
        if scaling:
            lines += [
                "Scaling efficiency = env-steps/s / (num_envs x env-steps/s of 1 env alone: AsyncVectorEnv(1), "
                "or the 1x1 server for remote layouts):",
                "",
                "| num_envs | " + " | ".join(names) + " |",
                "|---:|" + "---:|" * len(names),
            ]
            for w in results["latency"]:
                cells = {_family(name): v for name, v in scaling.get(w["num_envs"], {}).items()}
                lines.append(
                    f"| {w['num_envs']} | " + " | ".join(f"{cells[n]:.0%}" if n in cells else "" for n in names) + " |"
                )
            lines.append("")
    if results.get("ppo"):
        ppo = results["ppo"]
        lines += [f"**PPO end-to-end SPS (`learner train`, {ppo['env']}, {ppo['total_timesteps']:,} steps)**", ""]
        lines += ["| learner train | SPS | spread |", "|---|---:|---:|"]
        for r in ppo["results"]:
            if r["samples"]:
                lines.append(f"| {r['name']} | {r['median']:,.0f} | {_spread(r)} |")
            else:
                lines.append(f"| {r['name']} | - | ({r['error'] or 'not run'}) |")
        lines.append("")
    if results.get("rpc"):
        rpc = results["rpc"]
        rounds = max((len(r.get("samples_us") or []) for r in rpc["results"]), default=0)
        lines += [f"**One round trip (microseconds, median of {_rounds(rounds)})**", ""]
        lines += ["| | us | spread |", "|---|---:|---:|"]
        for r in rpc["results"]:
            spread = (r["max_us"] - r["min_us"]) / r["median_us"] if r["median_us"] else math.nan
            lines.append(f"| {r['name']} | {r['median_us']:,.0f} | {_spread(r, spread, 'samples_us')} |")
        lines.append("")
        overhead = rpc.get("remote_overhead_per_step_us")
        if overhead:
            each = ", ".join(f"{kind} {us:,.0f} us" for kind, us in overhead.items())
            lines += [
                f"Remote overhead per step: {each} (RemoteVectorEnv(1x1).step minus SyncVectorEnv(1).step: what "
                "serving one env adds to each step; a server with K envs pays it once per batched step; unix: "
                "on the step socket, unix-grpc: on gRPC's StepStream)",
                "",
            ]
    # Only the targets whose workloads ran: a partial run (--workloads cartpole-8, --suites rpc) has no
    # rows of "not run" for the rest, and no table when none ran.
    judged = [t for t in results.get("targets", []) if t.get("ran", t["met"] is not None or t.get("not_measured"))]
    if judged:
        lines += ["**Performance targets**", "", "| target | best remote | measured | met |", "|---|---|---|---|"]
        for t in judged:
            measured = ", ".join(f"{v:.2f} {k}" if v is not None else f"- {k}" for k, v in t["measured"].items())
            met = {True: "yes", False: "no", None: "no remote result"}[t["met"]]
            if t.get("not_measured"):
                met = f"not measured ({t['not_measured']})"
            lines.append(f"| {t['target']} | {t['best_remote'] or '-'} | {measured or '-'} | {met} |")
        lines += ["", "Measured: paired ratios, as above (the median of each round's ratio; PPO: of each run's).", ""]
    one = [
        what
        for what, rounds in (
            ("--rounds", results.get("meta", {}).get("rounds")),
            ("--ppo-rounds", results.get("config", {}).get("ppo_rounds") if results.get("ppo") else None),
        )
        if rounds == 1
    ]
    if one:
        lines += [f"Note: {' and '.join(one)} 1: each figure above is one sample, with no spread to judge it by.", ""]
    return "\n".join(lines)


def _rounds(n: int) -> str:
    """``5 rounds``, ``1 round``."""
    return f"{n} round{'' if n == 1 else 's'}"


def _spread(row: dict[str, Any], spread: float | None = None, samples: str = "samples") -> str:
    """A row's spread as a percentage; ``n/a`` where it has one sample (nothing to spread) or none given."""
    value = row.get("spread") if spread is None else spread
    if len(row.get(samples) or []) < 2 or value is None or math.isnan(value):
        return "n/a"
    return f"{value:.0%}"


def _family(name: str) -> str:
    """A latency variant's name without its size: ``remote 2x32 unix`` -> ``remote 2xK unix``."""
    parts = []
    for word in name.split():
        if "x" in word and word.split("x")[0].isdigit() and word.split("x")[1].isdigit():
            word = word.split("x")[0] + "xK"
        parts.append(word.split("(")[0] if "(" in word else word)
    return " ".join(parts)


# The chart is read scaled to a README's width (~900 px of its 1100): text no smaller than 9 pt.
_WIDTH = 10.0  # inches, two panels a row (at 110 dpi)
_FONT = 9.5  # tick labels, values, legends
_TITLE_FONT = 10.5  # each panel's title
_BAR_INCHES = 0.3  # per bar (per line of its label)
_TITLE_CHARS = 36  # a panel's title, wrapped
_TITLE_PAD = 0.08  # inches above the chart's title (it touched the image's top edge)
_KINDS = {  # the bars' colors, by kind of vector env, and the legend's words for them
    "remote": ("tab:blue", "RemoteVectorEnv (NxK: N servers x K envs)"),
    "async": ("tab:orange", "AsyncVectorEnv"),
    "sb3": ("tab:red", "SB3 SubprocVecEnv"),
    "sync": ("tab:gray", "SyncVectorEnv (in-process)"),
    "vector_entry_point": ("tab:green", "make_vec (in-process)"),
}


def plot_results(results: dict[str, Any], path: Path) -> Path:
    """One PNG: throughput per workload, latency-bound scaling, PPO SPS and round-trip costs, two panels a
    row (an odd last one spans the row). Bars start at 0 on a linear axis (their lengths compare as their
    values do), each with its value at its end and its min-max over rounds as a whisker; the title names
    the machine and the budget, and says when the machine was busy or the run interrupted."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels: list[tuple[str, Any]] = [("throughput", w) for w in results.get("throughput", [])]
    panels += [(k, results[k]) for k in ("latency", "ppo", "rpc") if results.get(k)]
    ncols = 2 if len(panels) > 1 else 1
    width = _WIDTH if ncols == 2 else _WIDTH * 0.65
    rows = [panels[i : i + ncols] for i in range(0, len(panels), ncols)]
    wraps = [26 if len(row) > 1 else 60 for row in rows]  # (a lone panel has the row's width)
    heights = [
        max(_panel_height(kind, data, wrap) for kind, data in row) for row, wrap in zip(rows, wraps, strict=True)
    ]
    kinds = {r["kind"] for w in results.get("throughput", []) for r in w["results"]}
    kinds |= {"remote" if r["backend"] == "remote" else "sync" for r in (results.get("ppo") or {}).get("results", [])}
    legend = [Patch(color=color, label=label) for kind, (color, label) in _KINDS.items() if kind in kinds]
    # A subfigure a row, each laid out on its own (a panel's long labels widen its own margin only), below
    # one for the title and the legend.
    top, title, legend_cols = _header(results, width, len(legend))
    # (a Figure of its own, as learner.plot's: no pyplot, so the caller's matplotlib backend stays as it is)
    fig = Figure(figsize=(width, top + sum(heights or [1.0])), layout="constrained")
    header, *lines = fig.subfigures(len(rows) + 1, 1, height_ratios=[top, *heights], squeeze=False)[:, 0]
    for row, line, wrap in zip(rows, lines, wraps, strict=True):
        for ax, (kind, data) in zip(line.subplots(1, len(row), squeeze=False)[0], row, strict=True):
            if kind == "throughput":
                _throughput_panel(ax, data, wrap)
            elif kind == "latency":
                _latency_panel(ax, results)
            elif kind == "ppo":
                ok = [r for r in data["results"] if r["samples"]]
                colors = [_KINDS["remote" if r["backend"] == "remote" else "sync"][0] for r in ok]
                _bars(ax, ok, "median", colors, wrap)
                ax.set_xlabel(
                    "env-steps/s of learner train (SPS), median\n(whiskers: min-max over runs)", fontsize=_FONT
                )
                ax.set_title(f"PPO end to end, {data['env']}", fontsize=_TITLE_FONT)
            else:
                _bars(ax, data["results"], "median_us", ["tab:purple"] * len(data["results"]), wrap)
                ax.set_xlabel("microseconds per round trip, median\n(whiskers: min-max over rounds)", fontsize=_FONT)
                ax.set_title("Cost of one round trip", fontsize=_TITLE_FONT)
    header.text(0.01, 1 - _TITLE_PAD / top, title, fontsize=11, ha="left", va="top")
    if legend:
        header.legend(handles=legend, loc="lower center", fontsize=_FONT, ncol=legend_cols, frameon=False)
    rundir.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))  # (its parent made too)
    return path


def _label(name: str) -> str:
    """A bar's name, shorter (the legend says the rest): ``remote 2x4 unix`` -> ``2x4 unix``,
    ``make_vec vector_entry_point(8)`` -> ``make_vec(8)``, ``in-process SyncVectorEnv(8)`` -> ``SyncVectorEnv(8)``."""
    for prefix in ("remote ", "in-process "):
        name = name.removeprefix(prefix)
    return name.replace("make_vec vector_entry_point", "make_vec")


def _panel_height(kind: str, data: Any, wrap: int) -> float:
    """Inches a panel takes: its title and axis, and a bar per line of each bar's label."""
    if kind == "latency":
        return 5.6
    rows = [r for r in data["results"] if r.get("samples") or r.get("median_us")]
    lines = sum(len(textwrap.wrap(_label(r["name"]), wrap)) for r in rows)
    titled = textwrap.wrap(data["title"], _TITLE_CHARS) if kind == "throughput" else [""]
    return 1.6 + 0.2 * len(titled) + _BAR_INCHES * max(lines, 3)


def _bars(ax: Any, rows: list[dict[str, Any]], key: str, colors: list[str], wrap: int) -> None:
    """Horizontal bars of ``row[key]`` from 0 on a linear axis, min-max whiskers where the rows have them,
    each bar's value written past its end."""
    from matplotlib.ticker import FuncFormatter

    unit = key.removeprefix("median")  # "" or "_us"
    values = [r[key] for r in rows]
    lows = [r.get(f"min{unit}", v) for r, v in zip(rows, values, strict=True)]
    highs = [r.get(f"max{unit}", v) for r, v in zip(rows, values, strict=True)]
    y = range(len(rows))
    err = [[v - lo for v, lo in zip(values, lows, strict=True)], [hi - v for v, hi in zip(values, highs, strict=True)]]
    ax.barh(y, values, xerr=err, color=colors, capsize=3, error_kw={"linewidth": 1})
    ax.set_yticks(list(y), [textwrap.fill(_label(r["name"]), wrap) for r in rows], fontsize=_FONT)
    ax.invert_yaxis()
    right = max(highs, default=1.0) or 1.0
    ax.set_xlim(0, right * 1.28)  # (room for the values)
    for i, (value, high) in enumerate(zip(values, highs, strict=True)):
        ax.text(high + right * 0.035, i, _short(value), va="center", fontsize=_FONT)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    ax.tick_params(axis="x", labelsize=_FONT)
    ax.grid(axis="x", alpha=0.3)


def _throughput_panel(ax: Any, workload: dict[str, Any], wrap: int) -> None:
    rows = [r for r in workload["results"] if r["samples"]]
    ax.set_title(textwrap.fill(workload["title"], _TITLE_CHARS), fontsize=_TITLE_FONT)
    if not rows:
        ax.set_title(f"{workload['title']}: nothing ran", fontsize=_TITLE_FONT)
        ax.text(
            0.5,
            0.5,
            "\n".join(sorted({r["error"] or "" for r in workload["results"]}))[:300],
            ha="center",
            va="center",
            wrap=True,
            fontsize=_FONT,
            transform=ax.transAxes,
        )
        return
    _bars(ax, rows, "median", [_KINDS.get(r["kind"], _KINDS["vector_entry_point"])[0] for r in rows], wrap)
    ax.set_xlabel("env-steps/s, median\n(whiskers: min-max over rounds)", fontsize=_FONT)


def _latency_panel(ax: Any, results: dict[str, Any]) -> None:
    # Scaling from 1 env (the target's measure) where the 1-env workload ran; else num_envs / delay.
    scaling = latency_scaling(results)
    series: dict[str, list[tuple[int, float]]] = {}
    for w in results["latency"]:
        for r in w["results"]:
            if not r["samples"]:
                continue
            value = scaling[w["num_envs"]].get(r["name"]) if scaling else r.get("efficiency")
            if value is not None:
                series.setdefault(_family(r["name"]), []).append((w["num_envs"], value))
    for name, points in sorted(series.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, [100 * v for v in ys], marker="o", label=name)
    ideal = "linear scaling from 1 env" if scaling else "num_envs / delay"
    ax.axhline(100, color="black", linewidth=0.8, linestyle="--", label=f"ideal ({ideal})")
    ax.axhline(85, color="tab:green", linewidth=0.8, linestyle=":", label="target at 64 envs (85 %)")
    ax.set_xscale("log", base=2)
    sizes = sorted({w["num_envs"] for w in results["latency"]})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.tick_params(labelsize=_FONT)
    ax.set_xlabel("num_envs", fontsize=_FONT)
    ax.set_ylabel(f"% of {ideal}", fontsize=_FONT)
    ax.set_ylim(0, 110)
    delay = results["latency"][0]["delay_ms"]
    ax.set_title(f"Latency-bound CartPole, {delay:g} ms per step", fontsize=_TITLE_FONT)
    ax.legend(fontsize=_FONT - 1, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    ax.grid(alpha=0.3)


def _short(value: float) -> str:
    """A tick label: 2000 -> 2k, 1400000 -> 1.4M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _budget(results: dict[str, Any]) -> str:
    """What each measurement ran for: rounds x seconds (throughput, latency, rpc), runs x steps (ppo)."""
    meta, parts = results.get("meta", {}), []
    if any(results.get(k) for k in ("throughput", "latency", "rpc")):
        rounds, seconds = meta.get("rounds", "?"), meta.get("seconds", "?")
        parts.append(f"{rounds} round{'' if rounds == 1 else 's'} x {seconds} s")
    if results.get("ppo"):
        ppo = results["ppo"]
        runs = results.get("config", {}).get("ppo_rounds") or max(
            (len(r["samples"]) for r in ppo["results"]), default=0
        )
        parts.append(f"PPO {runs} run{'' if runs == 1 else 's'} x {ppo['total_timesteps']:,} steps")
    return "; ".join(parts)


def _header(results: dict[str, Any], width: float, legend: int) -> tuple[float, str, int]:
    """The chart's title (the machine, the budget, the load; and, as bench.md says them, that the machine
    was busy or the run interrupted), wrapped to ``width`` inches; the inches it and a legend of ``legend``
    entries below it take; the legend's columns."""
    meta = results.get("meta", {})
    loads = [meta[k][0] for k in ("load_average_start", "load_average_end") if meta.get(k)]
    loads += [
        w["load_average_1m"] for k in ("throughput", "latency") for w in results.get(k, []) if "load_average_1m" in w
    ]
    load = f", 1-min load average {min(loads):.1f}-{max(loads):.1f} during the run" if loads else ""
    notes = [load_warning(meta)]
    if meta.get("interrupted"):
        notes.append("Interrupted: only the measurements that finished before the bench was stopped are here.")
    # ~0.094 inch per character at 11 pt, with a margin.
    title = "\n".join(
        textwrap.fill(line, max(40, int(width / 0.094)))
        for line in (
            ", ".join(
                part
                for part in (
                    f"envfleet learner bench: {meta.get('cpus', '?')} CPUs",
                    f"Python {meta.get('python', '?')}",
                    f"grpcio {meta.get('grpcio', '?')}",
                    _budget(results),  # ("" when nothing finished)
                )
                if part
            )
            + load,
            *(note for note in notes if note),
        )
    )
    top = _TITLE_PAD + 0.12 + 0.19 * (title.count("\n") + 1)
    ncol = 1
    if legend:  # as many columns as fit (~0.088 inch per character at 9.5 pt, plus the patch)
        longest = max(len(label) for _, label in _KINDS.values())
        ncol = max(1, min(legend, int(width / (longest * 0.088 + 0.6))))
        top += 0.1 + 0.23 * -(-legend // ncol)
    return top, title, ncol


def write_report(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``out``/bench.md and ``out``/bench.png of ``results`` (what ``learner bench`` writes beside
    bench.json); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    markdown = out / "bench.md"
    rundir.write_text(markdown, markdown_tables(results))
    return markdown, plot_results(results, out / "bench.png")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.benchmarks.report",
        description="Write bench.md and bench.png again from a bench.json of learner bench (nothing is measured).",
    )
    parser.add_argument("bench_json", type=Path, metavar="BENCH_JSON", help="a bench.json written by learner bench")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="where to write (default: beside it)")
    args = parser.parse_args(argv)
    try:
        results = json.loads(args.bench_json.read_text())
    except (OSError, ValueError) as err:
        parser.error(f"{args.bench_json}: {err}")
    suites = ("throughput", "latency", "ppo", "rpc")  # (learner.benchmarks.run.SUITES, whose import is heavier)
    if not isinstance(results, dict) or "meta" not in results or not any(results.get(k) for k in suites):
        if not isinstance(results, dict):
            got = f"a JSON {type(results).__name__}"
        else:
            got = f"an object with keys {', '.join(map(repr, results))}" if results else "an empty object"
        parser.error(
            f"{args.bench_json}: expected a bench.json of learner bench (its 'meta' and results of a suite: "
            f"{', '.join(suites)}), got {got}"
        )
    written = write_report(results, args.out or args.bench_json.parent)
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
