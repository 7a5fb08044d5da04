"""The benchmark's outputs: the performance targets checked, a Markdown table, and a PNG chart."""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "evaluate_targets", "latency_scaling", "load_warning", "markdown_tables", "plot_results"]

# What the latency and PPO targets are stated for; a run measuring something else does not judge them.
_TARGET_DELAY_MS = 2.0
_TARGET_PPO_ENV = "CartPole-v1"

# The performance targets (set when the project began): (workload, what is compared, threshold).
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


def _remote_names(workload: dict[str, Any] | None, layout: str | None = None, same_env_code: bool = True) -> list[str]:
    if workload is None:
        return []
    return [
        r["name"]
        for r in workload["results"]
        if r["kind"] == "remote"
        and (layout is None or r["layout"] == layout)
        and (not same_env_code or r["vectorization"] == "sync")
    ]


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: the measured ratio (best remote layout allowed), and whether it is met.

    Only remote variants that step the same env code as the baselines count (servers with
    ``--vectorization sync``); the others are reported beside.
    """
    workloads = {w["name"]: w for w in results.get("throughput", [])}
    out: list[dict[str, Any]] = []

    w = workloads.get("cartpole-8")
    best, vs_async, ratios = _best_ratio(w, _remote_names(w, "2x4"), "AsyncVectorEnv(8)")
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
        met = scaling >= 0.85 if not math.isnan(scaling) else eff >= 0.85
        out.append(_target(TARGETS[3], best_eff, measured, met, effs, ran=w is not None))

    ppo = results.get("ppo")
    if ppo and ppo["env"] != _TARGET_PPO_ENV:
        out.append(_not_measured(TARGETS[4], f"the ppo suite ran {ppo['env']}"))
    elif ppo:
        rows = {r["name"]: r for r in ppo["results"]}
        ref = next((r for r in ppo["results"] if r["backend"] == "gym" and r["num_envs"] == 8), None)
        cands = [r["name"] for r in ppo["results"] if r["backend"] == "remote" and r["num_envs"] == 8]
        ratios = {c: _paired(rows[c], ref) for c in cands if ref is not None and rows[c]["samples"]}
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


def load_warning(meta: dict[str, Any]) -> str:
    """A warning when the machine's 1-minute load average was at least its CPU count at the start or the
    end of the run (other work competed for the CPUs); "" otherwise."""
    cpus = meta.get("cpus")
    busy = [
        f"{meta[key][0]:.1f} at the {when}"
        for when, key in (("start", "load_average_start"), ("end", "load_average_end"))
        if cpus and meta.get(key) and meta[key][0] >= cpus
    ]
    if not busy:
        return ""
    return (
        f"Warning: the machine was busy: 1-minute load average {' and '.join(busy)}, at least its {cpus} CPUs; "
        "other work competed for them, so the figures may be low and their spread wide."
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
        lines += [f"**{w['title']}** (env-steps/s, median of {rounds} rounds)", ""]
        lines += [f"| vector env | env-steps/s | spread | {PAIRED_COLUMN} |", "|---|---:|---:|---:|"]
        for r in w["results"]:
            if not r["samples"]:
                lines.append(f"| {r['name']} | - | - | - ({r['error']}) |")
                continue
            ratio = _paired(r, rows[ref_name]) if ref_name else math.nan
            lines.append(f"| {r['name']} | {r['median']:,.0f} | {r['spread']:.0%} | {ratio:.2f} |")
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
                lines.append(f"| {r['name']} | {r['median']:,.0f} | {r['spread']:.0%} |")
            else:
                lines.append(f"| {r['name']} | - | ({r['error'] or 'not run'}) |")
        lines.append("")
    if results.get("rpc"):
        rpc = results["rpc"]
        rounds = max((len(r.get("samples_us") or []) for r in rpc["results"]), default=0)
        lines += [f"**One round trip (microseconds, median of {rounds} rounds)**", ""]
        lines += ["| | us | spread |", "|---|---:|---:|"]
        for r in rpc["results"]:
            spread = (r["max_us"] - r["min_us"]) / r["median_us"] if r["median_us"] else math.nan
            lines.append(f"| {r['name']} | {r['median_us']:,.0f} | {spread:.0%} |")
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


def _family(name: str) -> str:
    """A latency variant's name without its size: ``remote 2x32 unix`` -> ``remote 2xK unix``."""
    parts = []
    for word in name.split():
        if "x" in word and word.split("x")[0].isdigit() and word.split("x")[1].isdigit():
            word = word.split("x")[0] + "xK"
        parts.append(word.split("(")[0] if "(" in word else word)
    return " ".join(parts)


def plot_results(results: dict[str, Any], path: Path) -> Path:
    """One PNG: throughput per workload, latency-bound scaling, PPO SPS and round-trip costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    throughput = results.get("throughput", [])
    extra = [k for k in ("latency", "ppo", "rpc") if results.get(k)]
    ncols = max(len(throughput), len(extra), 1)
    nrows = (1 if throughput else 0) + (1 if extra else 0)
    fig, axes = plt.subplots(max(nrows, 1), ncols, figsize=(5.2 * ncols, 4.8 * max(nrows, 1)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    colors = {"remote": "tab:blue", "async": "tab:orange", "sb3": "tab:red", "sync": "tab:gray"}
    _KIND_LABELS = {
        "RemoteVectorEnv": "tab:blue",
        "AsyncVectorEnv": "tab:orange",
        "SB3 SubprocVecEnv": "tab:red",
        "SyncVectorEnv (in-process)": "tab:gray",
        "make_vec (in-process)": "tab:green",
    }

    for ax, w in zip(axes[0], throughput, strict=False):
        ax.set_visible(True)
        rows = [r for r in w["results"] if r["samples"]]
        if not rows:
            ax.set_title(f"{w['title']}: nothing ran", fontsize=9)
            ax.text(
                0.5,
                0.5,
                "\n".join(sorted({r["error"] or "" for r in w["results"]}))[:300],
                ha="center",
                va="center",
                wrap=True,
                fontsize=7,
                transform=ax.transAxes,
            )
            continue
        y = range(len(rows))
        medians = [r["median"] for r in rows]
        err = [[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]]
        ax.barh(y, medians, xerr=err, color=[colors.get(r["kind"], "tab:green") for r in rows], capsize=3)
        ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        _log_axis(ax, min(r["min"] for r in rows), max(r["max"] for r in rows))
        ax.set_xlabel("env-steps/s (median, bars: min-max over rounds)", fontsize=8)
        ax.set_title(textwrap.fill(w["title"], 40), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=c, label=label) for label, c in _KIND_LABELS.items()] if throughput else []

    if not extra:
        return _save(fig, results, path, legend)
    row = axes[1 if throughput else 0]
    col = 0
    if results.get("latency"):
        ax = row[col]
        col += 1
        ax.set_visible(True)
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
        ax.set_xlabel("num_envs")
        ax.set_ylabel(f"% of {ideal}")
        ax.set_ylim(0, 110)
        delay = results["latency"][0]["delay_ms"]
        ax.set_title(f"Latency-bound CartPole, {delay:g} ms per step", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if results.get("ppo"):
        ax = row[col]
        col += 1
        ax.set_visible(True)
        rows = [r for r in results["ppo"]["results"] if r["samples"]]
        y = range(len(rows))
        ax.barh(
            y,
            [r["median"] for r in rows],
            xerr=[[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]],
            color=["tab:blue" if r["backend"] == "remote" else "tab:gray" for r in rows],
            capsize=3,
        )
        ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("env-steps/s of learner train (SPS)", fontsize=8)
        ax.set_title(f"PPO end to end, {results['ppo']['env']}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    if results.get("rpc"):
        ax = row[col]
        ax.set_visible(True)
        rows = results["rpc"]["results"]
        y = range(len(rows))
        ax.barh(y, [r["median_us"] for r in rows], color="tab:purple")
        ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("microseconds per round trip (median)", fontsize=8)
        ax.set_title("Cost of one round trip", fontsize=9)
        ax.grid(axis="x", alpha=0.3)

    return _save(fig, results, path, legend)


def _short(value: float) -> str:
    """A tick label: 2000 -> 2k, 1400000 -> 1.4M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _log_axis(ax: Any, low: float, high: float) -> None:
    """A log x-axis whose labelled ticks are plain numbers, enough of them whatever the data's range
    (matplotlib labels only powers of 10, which a range within one decade may not contain)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    decades = math.log10(high / low) if low > 0 and high > 0 else 3.0
    subs = (1.0, 3.0) if decades > 2 else (1.0, 2.0, 5.0) if decades > 0.7 else tuple(float(i) for i in range(1, 10))
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelsize=7)


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


def _save(fig: Any, results: dict[str, Any], path: Path, legend: list[Any]) -> Path:
    import matplotlib.pyplot as plt

    meta = results.get("meta", {})
    loads = [meta[k][0] for k in ("load_average_start", "load_average_end") if meta.get(k)]
    loads += [
        w["load_average_1m"] for k in ("throughput", "latency") for w in results.get(k, []) if "load_average_1m" in w
    ]
    load = f", 1-min load average {min(loads):.1f}-{max(loads):.1f} during the run" if loads else ""
    width, height = fig.get_size_inches()
    # Wrapped to the figure's width (~0.085 inch per character at 10 pt, with a margin), the legend below it, both
    # above the panels: with one column of panels neither fits on one line.
    title = textwrap.fill(
        f"envfleet learner bench: {meta.get('cpus', '?')} CPUs, Python {meta.get('python', '?')}, grpcio "
        f"{meta.get('grpcio', '?')}, {_budget(results)}{load}",
        max(40, int(width / 0.085)),
    )
    title_top = 0.12 + 0.19 * (title.count("\n") + 1)  # inches the title takes
    top = title_top
    if legend:  # as many columns as fit (~0.065 inch per character at 7 pt, plus the patch)
        ncol = max(1, min(len(legend), int(width / (max(len(h.get_label()) for h in legend) * 0.065 + 0.5))))
        top += 0.05 + 0.2 * -(-len(legend) // ncol)
    total = height + top
    fig.set_size_inches(width, total)
    fig.tight_layout(rect=(0, 0, 1, 1 - top / total))  # (before the title, which it would make room for again)
    fig.suptitle(title, fontsize=10, x=0.02, y=1 - 0.06 / total, ha="left", va="top")
    if legend:
        fig.legend(
            handles=legend,
            loc="upper center",
            bbox_to_anchor=(0.5, 1 - title_top / total),
            fontsize=7,
            ncol=ncol,
            frameon=False,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
