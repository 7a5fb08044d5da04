"""``learner plot``: return against env steps and against wall time, one line per run (matplotlib, Agg)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from learner import rundir

__all__ = ["plot_runs"]

log = logging.getLogger(__name__)


def _load(run: Path) -> tuple[Path, list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """A run dir's metrics rows with a mean return, its summary (None before the run ends) and its config."""
    if not run.exists():
        raise FileNotFoundError(f"{run}: no such run dir")
    metrics = run / rundir.METRICS
    if not metrics.is_file():
        raise FileNotFoundError(f"{run}: expected a run dir with {rundir.METRICS}, found none")
    rows = [r for r in rundir.read_jsonl(metrics) if r.get("episodic_return_mean") is not None]
    summary = rundir.read_json(run / rundir.SUMMARY) if (run / rundir.SUMMARY).is_file() else None
    config = rundir.read_json(run / rundir.CONFIG) if (run / rundir.CONFIG).is_file() else {}
    return run, rows, summary, config


def _env(config: dict[str, Any]) -> str | None:
    """The env a run trained on, as its config.json names it (None without one)."""
    return config.get("args", {}).get("env") or config.get("envs", {}).get("env_id") or None


def _label(run: Path, summary: dict[str, Any] | None, env: str | None = None) -> str:
    label = run.name or str(run)
    if env is not None:
        label += f" [{env}]"
    if summary and summary.get("solved_at_step") is not None:
        label += f" (solved at {summary['solved_at_step']:,} steps, {summary['solved_at_seconds']:.1f} s)"
    return label


def plot_runs(
    runs: Sequence[str | Path],
    output: str | Path,
    title: str | None = None,
    groups: Sequence[str] | None = None,
) -> Path:
    """Write a PNG of the recent mean return of each run in ``runs`` against steps and seconds.

    With ``groups`` (one name per run), runs of a group share a colour and one legend entry, e.g.
    the seeds of one configuration. A run's "solved" bar (its config's ``solved_threshold``) is a dashed
    line labelled with the envs it belongs to; runs of different envs have their env in their legend
    entry, and the default title says they differ.
    """
    loaded = [_load(Path(run)) for run in runs]
    empty = {run for run, rows, summary, _ in loaded if not rows and (summary or {}).get("final_return_mean") is None}
    if len(empty) == len(loaded):
        raise ValueError(
            f"nothing to plot: no mean return in {', '.join(map(str, runs))} (a run's {rundir.METRICS} has one per "
            "update once an episode has ended)"
        )
    for run in (run for run, *_ in loaded if run in empty):
        log.warning("%s: no mean return yet, left out of the plot", run)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_steps, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    plotted = [(run, config) for run, _, _, config in loaded if run not in empty]
    envs = {env for _, config in plotted if (env := _env(config)) is not None}
    mixed = len(envs) > 1  # runs of different envs: each says its own
    # Each solved bar, with the envs whose runs it is for (runs of one env may differ: --stop-at-return).
    thresholds: dict[float, set[str]] = {}
    for _, config in plotted:
        if config.get("solved_threshold") is not None:
            env = _env(config)
            thresholds.setdefault(float(config["solved_threshold"]), set()).update([env] if env else [])
    colours: dict[str, Any] = {}
    solved_any = False
    for i, (run, rows, summary, config) in enumerate(loaded):
        group = groups[i] if groups is not None else None
        if run in empty:
            continue
        env = _env(config) if mixed else None
        steps = [r["global_step"] for r in rows]
        seconds = [r["seconds"] for r in rows]
        returns = [r["episodic_return_mean"] for r in rows]
        if summary and summary.get("final_return_mean") is not None and summary["total_steps"] > max(steps, default=0):
            # A run that stopped mid-rollout (solved, interrupted) ends after its last update's line.
            steps.append(summary["total_steps"])
            seconds.append(summary["seconds"])
            returns.append(summary["final_return_mean"])
        if group is None:
            (line,) = by_steps.plot(steps, returns, label=_label(run, summary, env))
        elif group in colours:
            (line,) = by_steps.plot(steps, returns, color=colours[group], linewidth=1)
        else:
            (line,) = by_steps.plot(steps, returns, label=group if env is None else f"{group} [{env}]", linewidth=1)
            colours[group] = line.get_color()
        by_time.plot(seconds, returns, color=line.get_color(), linewidth=line.get_linewidth())
        if summary and summary.get("solved_at_step") is not None:
            solved_any = True
            by_steps.axvline(summary["solved_at_step"], color=line.get_color(), linestyle=":", linewidth=1)
            by_time.axvline(summary["solved_at_seconds"], color=line.get_color(), linestyle=":", linewidth=1)
    # One grey shade per bar (up to 4), so that bars of different envs tell apart.
    shades = ["grey", "black", "silver", "dimgrey"]
    for k, threshold in enumerate(sorted(thresholds)):
        whose = f" ({', '.join(sorted(thresholds[threshold]))})" if thresholds[threshold] else ""
        style = {"color": shades[k % len(shades)], "linestyle": "--", "linewidth": 1}
        by_steps.axhline(threshold, label=f"solved{whose}: mean return >= {threshold:g}", **style)
        by_time.axhline(threshold, **style)
    by_steps.set_xlabel("env steps")
    by_time.set_xlabel("wall time (s)")
    by_steps.set_ylabel("mean return, last 20 episodes")
    for ax in (by_steps, by_time):
        ax.grid(alpha=0.3)
    handles, labels = by_steps.get_legend_handles_labels()
    if solved_any:
        (marker,) = by_steps.plot([], [], color="grey", linestyle=":", linewidth=1)
        handles.append(marker)
        labels.append("where a run solved it")
    # Below the axes, where it hides no line.
    columns = min(2, len(labels)) or 1
    legend_rows = -(-len(labels) // columns)
    height = 4.2 + 0.18 * legend_rows
    fig.set_size_inches(11, height)
    legend_height = (0.1 + 0.17 * legend_rows) / height
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    default_title = ("runs of different envs: " if mixed else "") + ", ".join(sorted(envs))
    fig.suptitle(title or default_title or "returns")
    fig.tight_layout(rect=(0, legend_height, 1, 1))
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
