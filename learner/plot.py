"""``learner plot``: return against env steps and against wall time, one line per run (matplotlib, to PNG)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from env_server.protocol import escape_surrogates
from learner import rundir
from learner.config import Args
from learner.errors import os_reason

__all__ = ["PlotWriteError", "config_groups", "plot_runs"]

log = logging.getLogger(__name__)


class PlotWriteError(ValueError):
    """The plot's file could not be written (a full disk, a folder that cannot be written): where and why."""


_Point = tuple[Any, Any, Any]
"""An update's point: its env steps, seconds and mean return, as its metrics row gives them."""

MAX_POINTS = 10_000
"""The points of a run's line, at most: a longer run's are thinned as read (:func:`_thin`), so that plotting
it (``learner plot``, and every run at its end) costs as little memory however long it ran."""


def _load(run: Path) -> tuple[Path, list[_Point] | None, dict[str, Any] | None, dict[str, Any]]:
    """A run dir's points, one per metrics row with a mean return (thinned to :data:`MAX_POINTS`; None
    without a metrics file), its summary (None before the run ends) and its config."""
    if not run.exists():
        raise FileNotFoundError(f"{run}: no such run dir")
    metrics = run / rundir.METRICS
    if not metrics.is_file():
        return run, None, None, {}
    skipped: list[int] = []  # (lines that are no JSON: bytes that are no UTF-8, a hand edit)
    others = 0  # (rows that are no update's, as learner train writes them: another program's lines, a hand edit)

    def points() -> Iterator[_Point]:
        nonlocal others
        # (one at a time: only what is drawn is kept)
        for row in rundir.iter_jsonl(metrics, skipped=skipped, parse=_drawn_of):
            if not _is_row(row):
                others += 1
            elif row["episodic_return_mean"] is not None:
                yield row["global_step"], row["seconds"], row["episodic_return_mean"]

    try:
        kept = _thin(points(), MAX_POINTS)
    except OSError as err:
        raise _unreadable(metrics, "a run's metrics", err) from None
    if others or skipped:
        log.warning(
            "%s: %d line(s) without %s left out (learner train writes a JSON object of numbers per update)",
            metrics,
            others + len(skipped),
            ", ".join(_ROW_KEYS),
        )
    summary = _read(run / rundir.SUMMARY) if (run / rundir.SUMMARY).is_file() else None
    return run, kept, summary if isinstance(summary, dict) else None, _run_config(run) or {}


def _thin(points: Iterable[_Point], bound: int) -> list[_Point]:
    """``points`` (a run's, in order) as they are where there are at most ``bound`` (4 or more); else at most
    ``bound`` of them: the first, the last, and of each stretch of consecutive points (all as long, but the
    last) the one of its lowest return and the one of its highest, in their order, so that the line keeps
    its range and a spike of one update. Read as they come, holding no more than ``bound`` points."""
    raw: list[_Point] = []
    stretches: list[tuple[tuple[int, _Point], tuple[int, _Point]]] = []  # (each one's lowest and highest)
    size = 0  # (points a stretch spans, once they are thinned)
    limit = max(1, (bound - 2) // 2)
    last: tuple[int, _Point] | None = None
    for i, point in enumerate(points):
        last = (i, point)
        if not size:
            raw.append(point)
            if len(raw) <= bound:
                continue
            size, stretches = 1, [((j, p), (j, p)) for j, p in enumerate(raw)]
            raw = raw[:1]  # (the first point)
        elif i // size == len(stretches):
            stretches.append((last, last))
        else:
            low, high = stretches[-1]
            stretches[-1] = (last if point[2] < low[1][2] else low, last if point[2] > high[1][2] else high)
        while len(stretches) > limit:  # (pairs of stretches made one, twice as long)
            stretches = [_merged(stretches[j : j + 2]) for j in range(0, len(stretches), 2)]
            size *= 2
    if not size or last is None:
        return raw
    kept = {0: raw[0], last[0]: last[1]}
    kept.update(ends for low_high in stretches for ends in low_high)
    return [kept[i] for i in sorted(kept)]


def _merged(
    stretches: list[tuple[tuple[int, _Point], tuple[int, _Point]]],
) -> tuple[tuple[int, _Point], tuple[int, _Point]]:
    """One stretch of one or two consecutive ones (their lowest and highest points, each with its index)."""
    low = min((low for low, _ in stretches), key=lambda found: found[1][2])
    high = max((high for _, high in stretches), key=lambda found: found[1][2])
    return low, high


# What a metrics row must hold to be plotted.
_ROW_KEYS = ("global_step", "seconds", "episodic_return_mean")

_NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_DRAWN = re.compile(
    rf'\{{"update": -?\d+, "global_step": ({_NUMBER}), "seconds": ({_NUMBER}), "sps": [^,]*, "sps_update": [^,]*, '
    rf'"transitions_per_s": [^,]*, "episodic_return_mean": ({_NUMBER}|null), '
)
"""How a metrics row as learner train writes it (``learner.records.metrics_row``) starts, up to what is drawn."""


def _drawn_of(line: str) -> Any:
    """A metrics line as json.loads reads it; of a row as learner train writes it (:data:`_DRAWN`, one
    object to the line's end), only what is drawn of it (a long run's rows, 2 KB each, took seconds
    to parse whole)."""
    match = _DRAWN.match(line)
    if match is None or line.count("{") != 1 or not line.rstrip().endswith("}"):
        return json.loads(line)
    step, seconds, returned = (_json_number(text) for text in match.groups())
    return {"global_step": step, "seconds": seconds, "episodic_return_mean": returned}


def _json_number(text: str) -> int | float | None:
    """A JSON number (or null) as json.loads reads it: an int unless it has a fraction or an exponent."""
    if text == "null":
        return None
    return float(text) if any(c in text for c in ".eE") else int(text)


def _no_metrics(run: Path) -> str:
    """What is wrong with ``run``, which has no metrics file: a folder without one, or a file (one of a
    run dir's, say: then its folder is the run dir to pass)."""
    if not run.is_file():
        return f"{run}: expected a run dir with {rundir.METRICS}, found none"
    of_a_run = run.name in (rundir.METRICS, rundir.CONFIG, rundir.SUMMARY)
    return f"{run}: expected a run dir, got a file" + (f" (pass its run dir, {run.parent})" if of_a_run else "")


def _is_row(row: Any) -> bool:
    """Whether ``row`` (a metrics line, as read) is an update's that can be plotted: numbers for
    :data:`_ROW_KEYS` (the return None before an episode has ended)."""

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    if not (isinstance(row, dict) and all(k in row for k in _ROW_KEYS)):
        return False
    returned = row["episodic_return_mean"]
    return number(row["global_step"]) and number(row["seconds"]) and (returned is None or number(returned))


def _read(path: Path, *, warn: bool = True) -> Any:
    """A JSON file of a run dir; None where it cannot be read (a damaged one: one run's, which the plot of
    the others should not fail on), with a warning naming it unless not ``warn`` (json's own names no file)."""
    try:
        return rundir.read_json(path)
    except (OSError, ValueError) as err:
        if warn:
            log.warning("%s; the run is plotted as one without it", _unreadable(path, "a run's JSON file", err))
        return None


def _unreadable(path: Path, what: str, err: Exception) -> ValueError:
    """The error for a run dir's file ``path`` that cannot be read (``err``), naming it (json's own, and
    UTF-8's, name no file)."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else err
    return ValueError(f"{path}: expected {what}, but it cannot be read ({reason})")


def _run_config(run: Path, *, warn: bool = True) -> dict[str, Any] | None:
    """``run``'s config.json, None without one, with one that cannot be read (a warning, unless not
    ``warn``), or with one that is no run's (no ``args`` object: a folder of something else that has a
    config.json), which is plotted as a folder without one is."""
    config = _read(run / rundir.CONFIG, warn=warn) if (run / rundir.CONFIG).is_file() else None
    return config if rundir.is_run_config(config) else None


def _env(config: dict[str, Any]) -> str | None:
    """The env a run trained on, as its config.json names it (None without one)."""
    return config.get("args", {}).get("env") or config.get("envs", {}).get("env_id") or None


# What of a run's setup makes it another configuration (a group of `learner plot --by-config`): the env,
# how it was served, the device and policy, and PPO's hyperparameters as resolved (a preset's default and
# the same value given by hand are alike), and the budget where the learning rate or the clip anneals over
# it. Not: the seed, --stop-at-return, where it wrote, timeouts, security.
_SETUP_ARGS = (
    "backend",
    "transport",
    "step_socket",
    "step_delay_ms",
    "pipeline_groups",
    "overlap_update",
    "torch_threads",  # (torch's sums run in another order on other thread counts: another curve)
    "torch_deterministic",
)
_SETUP_ENVS = ("env_kwargs", "num_envs", "wrappers", "max_episode_steps", "autoreset_mode")
_ARG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Args) if f.default is not dataclasses.MISSING}
"""The options' defaults: an option a run's config.json lacks was added since, and that run did as its default does."""


def _setup(config: dict[str, Any]) -> dict[str, Any]:
    """What of ``config`` (a run's config.json) makes its configuration. An option an older version's lacks
    did not exist then: its default (what that version did). A record it lacks (its envs', as older
    versions or servers too old to say left them out; its policy, device) is left out, for
    :func:`_fill_unrecorded`; but env kwargs and a time limit given as options stand in for their record."""
    args, envs = config.get("args", {}), config.get("envs", {})
    setup: dict[str, Any] = {"env": _env(config)}
    setup.update({key: args[key] if key in args else _ARG_DEFAULTS.get(key) for key in _SETUP_ARGS})
    for key in _SETUP_ENVS:
        if envs.get(key) is not None:
            setup[key] = envs[key]
        elif key in ("env_kwargs", "max_episode_steps") and args.get("servers") is None and args.get(key):
            setup[key] = args[key]  # (the envs a run made, with the kwargs and time limit it was given)
    if "addresses" in envs:
        setup["servers"] = len(envs["addresses"] or ())
    setup.update({key: config[key] for key in ("device", "policy") if key in config})
    ppo = config.get("ppo", {})
    # (the budget changes learning where the learning rate or the clip anneals over it)
    annealed = ppo.get("anneal_lr") or ppo.get("anneal_clip")
    setup.update({key: value for key, value in ppo.items() if key != "total_timesteps" or annealed})
    return setup


def _resolved(run: str | Path) -> Path:
    """``run``'s real path, links followed (os.path.realpath: a loop of links, which Path.resolve()
    raises for, is left as far as it went, and the run then said to be no run dir, as before)."""
    return Path(os.path.realpath(run))


def _first_of_each(runs: Sequence[str | Path]) -> list[int]:
    """For each of ``runs``, the index of the first one that is the same folder, however spelt
    (``runs/cp``, ``./runs/cp/``, a symlink to it; compared resolved): its own for a run given once."""
    first: dict[Path, int] = {}
    return [first.setdefault(_resolved(run), i) for i, run in enumerate(runs)]


def config_groups(runs: Sequence[str | Path]) -> list[str]:
    """A group name for each of ``runs``: runs whose config.json differ in nothing but the seed and
    what does not change learning (run dir, --stop-at-return, timeouts, security, logging; the budget
    where nothing anneals over it) are one group, named
    by what sets it apart from the others (``gamma=0.98, num_envs=8``), or by its env when there is one
    group. A run without a config.json (or with one that is no run's, or that cannot be read) is a group
    of its own, named after its folder."""
    configs = [_run_config(run, warn=False) for run in map(Path, runs)]  # (plot_runs warns of one unreadable)
    setups = [None if config is None else _setup(config) for config in configs]
    known = [setup for setup in setups if setup is not None]
    _fill_unrecorded(known)
    # (of each run once: one given twice is plot_runs' to warn of, as it draws it once)
    distinct = [i for i, first in enumerate(_first_of_each(runs)) if first == i]
    _warn_of_repeated_seeds(
        [Path(runs[i]) for i in distinct], [configs[i] for i in distinct], [setups[i] for i in distinct]
    )
    keys = dict.fromkeys(key for setup in known for key in setup)
    differ = [key for key in keys if len({_text(setup[key]) if key in setup else "?" for setup in known}) > 1]

    folders = _names(list(map(Path, runs)))

    def named(text: Callable[[Any], str]) -> list[str]:
        names = []
        for run, setup in zip(map(Path, runs), setups, strict=True):
            if setup is None:
                names.append(folders[run])
            elif differ:
                names.append(", ".join(f"{key}={text(setup[key]) if key in setup else '?'}" for key in differ))
            else:
                names.append(setup.get("env") or "runs")
        return names

    # A sweep's sampled values (learning_rate=0.0016005454035309423) shown to 4 significant digits,
    # unless that would make two configurations one.
    names, short = named(_text), named(_short)
    return short if len(set(short)) == len(set(names)) else names


def _short(value: Any) -> str:
    """A setup value as a label shows it, a float to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else _text(value)


def _fill_unrecorded(setups: list[dict[str, Any]]) -> None:
    """A record some runs' setups lack (runs of an older version, whose config.json did not record it: see
    :func:`_setup`) takes the value that every run recording it shares, where they share one: runs of one
    configuration from before and after a version are one group. Where those runs differ, it stays
    missing ("?" in names)."""
    for key in dict.fromkeys(key for setup in setups for key in setup):
        values = {_text(setup[key]): setup[key] for setup in setups if key in setup}
        if len(values) == 1:
            (value,) = values.values()
            for setup in setups:
                setup.setdefault(key, value)


def _warn_of_repeated_seeds(
    runs: list[Path], configs: list[dict[str, Any] | None], setups: list[dict[str, Any] | None]
) -> None:
    """Runs are deterministic per seed: two runs of one configuration and one seed are one result counted
    twice in the group's mean (a copy of a run dir, say). ``configs``: the runs' config.json (None
    without one), ``setups``: what of each makes its configuration (see _setup)."""
    seen: dict[tuple[str, Any], Path] = {}
    for run, config, setup in zip(runs, configs, setups, strict=True):
        if config is None or setup is None:
            continue
        seed = config.get("args", {}).get("seed")
        key = (_text(setup), seed)
        if key in seen:
            log.warning(
                "%s and %s: the same configuration and seed (%s), so the same run twice in one mean "
                "(runs are deterministic per seed); leave one out",
                seen[key],
                run,
                seed,
            )
        else:
            seen[key] = run


def _text(value: Any) -> str:
    """A setup value as a label shows it (and as setups compare: JSON, keys sorted)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _names(runs: Sequence[Path]) -> dict[Path, str]:
    """How the legend names each run: its folder's name, or, where two runs' folders have one name
    (runs/a/cp, runs/b/cp), the fewest last parts of their paths that tell them apart (a/cp, b/cp);
    ``.`` is named as the folder it is."""
    parts = {run: Path(os.path.abspath(run)).parts for run in runs}  # (not resolved: runs/latest stays "latest")
    names: dict[Path, str] = {}
    for run in runs:
        for n in range(1, len(parts[run]) + 1):
            name = "/".join(parts[run][-n:])
            if all(
                other == run or parts[other] == parts[run] or parts[other][-n:] != parts[run][-n:] for other in runs
            ):
                break
        names[run] = name or str(run)
    return names


LABEL_WIDTH = 100
"""The characters of a legend entry's line, at most (where it has spaces to break at): 100 of its 8-point
text take about 60 % of the figure's width."""


def _with_env(group: str, env: str) -> str:
    """The legend entry of ``group`` (see :func:`config_groups`), of runs of ``env``, where the runs plotted
    are of different envs: the env first, as the group names it where the groups differ in it
    (``CartPole-v1: num_envs=8, ...``), else after it (a folder's name: ``noconf [Pendulum-v1]``)."""
    if group == f"env={env}":
        return env
    if group.startswith(f"env={env}, "):
        return f"{env}: {group.removeprefix(f'env={env}, ')}"
    return f"{group} [{env}]"


def _label(name: str, summary: dict[str, Any] | None, env: str | None = None) -> str:
    label = name
    if env is not None:
        label += f" [{env}]"
    if summary and summary.get("solved_at_step") is not None:
        label += f" (solved at {summary['solved_at_step']:,} steps, {summary['solved_at_seconds']:.1f} s)"
    return label


def _common_grid(curves: Sequence[tuple[Sequence[float], Sequence[float]]]) -> Any:
    """The x of every curve's points, where all of ``curves`` ((x, y) each) have points: empty, or
    one point, when they do not overlap."""
    import numpy as np

    start = max(x[0] for x, _ in curves)
    end = min(x[-1] for x, _ in curves)
    grid = np.unique(np.concatenate([np.asarray(x, dtype=float) for x, _ in curves]))
    return grid[(grid >= start) & (grid <= end)]


def _draw_band(ax: Any, curves: Sequence[tuple[Sequence[float], Sequence[float]]], colour: Any) -> None:
    """The mean of ``curves`` ((x, y) each: runs of one group) as a bold line, their lowest to highest
    shaded, where every curve has points (each interpolated linearly between its own): runs stopped at
    --stop-at-return end it at the first to stop."""
    import numpy as np

    grid = _common_grid(curves)
    if grid.size < 2:
        return
    values = np.stack([np.interp(grid, np.asarray(x, dtype=float), np.asarray(y, dtype=float)) for x, y in curves])
    ax.fill_between(grid, values.min(axis=0), values.max(axis=0), color=colour, alpha=0.15, linewidth=0)
    ax.plot(grid, values.mean(axis=0), color=colour, linewidth=2)


EVAL_KEY = "eval/return_mean"
"""The metrics column of an evaluation's mean return (learner train --eval-every), marked on the steps panel."""


def _eval_points(run: Path) -> tuple[list[float], list[float]]:
    """The steps and mean returns of ``run``'s evaluations (--eval-every: the rows with :data:`EVAL_KEY`), read
    from its metrics as they come (only the lines that name the key are parsed); none where it has none or its
    metrics cannot be read (the returns' line is drawn without them)."""
    steps: list[float] = []
    returns: list[float] = []
    marker = f'"{EVAL_KEY}"'
    try:
        with open(run / rundir.METRICS, encoding="utf-8", errors="replace") as f:
            for line in f:
                if marker not in line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                step, value = (row.get(key) if isinstance(row, dict) else None for key in ("global_step", EVAL_KEY))
                if isinstance(step, int | float) and isinstance(value, int | float) and math.isfinite(value):
                    steps.append(step)
                    returns.append(value)
    except OSError:
        return [], []
    return steps, returns


def _series(points: list[_Point], summary: dict[str, Any] | None) -> tuple[list[Any], list[Any], list[Any]]:
    """A run's steps, seconds and mean returns, one per update as loaded (and its end, when it stopped
    mid-rollout)."""
    steps = [step for step, _, _ in points]
    seconds = [second for _, second, _ in points]
    returns = [returned for _, _, returned in points]
    if summary and summary.get("final_return_mean") is not None and summary["total_steps"] > max(steps, default=0):
        # A run that stopped mid-rollout (solved, interrupted) ends after its last update's line.
        steps.append(summary["total_steps"])
        seconds.append(summary["seconds"])
        returns.append(summary["final_return_mean"])
    return steps, seconds, returns


def plot_runs(
    runs: Sequence[str | Path],
    output: str | Path,
    title: str | None = None,
    groups: Sequence[str] | None = None,
    *,
    output_name: str | None = "-o/--output",
) -> Path:
    """Write a PNG of the recent mean return of each run in ``runs`` against steps and seconds.

    With ``groups`` (one name per run), runs of a group share a colour and one legend entry, e.g.
    the seeds of one configuration (see :func:`config_groups`): a group of several runs is drawn as
    their mean, bold, the range between their lowest and highest shaded and each run faint. A run's
    "solved" bar (its config's ``solved_threshold``) is a dashed line labelled with the envs it belongs
    to; runs of different envs have their env in their legend entry (first, where their groups differ in
    it), and the default title says they differ. An entry too long for the figure is wrapped.

    A run dir given twice (``runs/cp runs/cp``, or spelt otherwise: ``./runs/cp/``, a link to it) is drawn
    once, with a warning naming it (two identical lines, one over the other, looked like one run; in a
    group, it counted twice in the mean). A folder in ``runs`` without a metrics file (or a file), or a run
    with no mean return yet, is left out with a warning while another run can be plotted
    (FileNotFoundError or ValueError when none can); a run's summary.json or config.json that cannot be
    read is named in a warning, and the run plotted as one without it, and lines of its metrics that are
    no update's (no JSON, bytes that are no UTF-8) are left out, saying how many. A run of more than
    :data:`MAX_POINTS` updates is drawn from that many of its points, each stretch's lowest and highest
    (read as they come: a long run's metrics are never all in memory). The file is written
    atomically; ValueError, naming ``output_name`` (the option that gave ``output``; None: no option did), where
    it cannot be.
    Returns the path written (with ``.png`` added to a name without a suffix).
    """
    runs, groups = _drawn_once(runs, groups)
    loaded = [_load(Path(run)) for run in runs]
    empty = _left_out(loaded)

    import matplotlib
    from matplotlib.figure import Figure

    # A Figure of its own, not pyplot's: pyplot would need a backend that draws off screen (Agg), and
    # switching to it for the whole process would stop a notebook's inline figures from showing after
    # train() (which plots) or plot_runs. savefig draws it with Agg all the same.
    fig = Figure(figsize=(11, 4.2))
    by_steps, by_time = fig.subplots(1, 2, sharey=True)
    plotted = [(run, config) for run, _, _, config in loaded if run not in empty]
    lines = len({groups[i] for i, (run, *_) in enumerate(loaded) if run not in empty}) if groups else len(plotted)
    if lines > len(matplotlib.rcParams["axes.prop_cycle"]):  # (its 10 colours would repeat: tab20's then)
        _use_tab20(by_steps, by_time)
    envs = {env for _, config in plotted if (env := _env(config)) is not None}
    mixed = len(envs) > 1  # runs of different envs: each says its own
    thresholds = _thresholds(plotted)
    series = {run: _series(rows, summary) for run, rows, summary, _ in loaded if run not in empty and rows is not None}
    panels = _Panels(by_steps, by_time, _members(loaded, groups, series))
    names = _names([run for run, *_ in loaded])
    for i, (run, _, summary, config) in enumerate(loaded):
        group = groups[i] if groups is not None else None
        if run not in series:
            continue
        panels.draw_run(series[run], names[run], summary, _env(config) if mixed else None, group)
        panels.draw_evals(_eval_points(run))
    panels.draw_bands()
    panels.draw_thresholds(thresholds)
    legend_height = _labels_and_legend(fig, by_steps, by_time, solved_any=panels.solved_any, one_run=len(plotted) == 1)
    default_title = ("runs of different envs: " if mixed else "") + ", ".join(sorted(envs))
    fig.suptitle(escape_surrogates(title or default_title or "returns"))
    fig.tight_layout(rect=(0, legend_height, 1, 1))
    return _save(fig, output, output_name)


_Series = tuple[list[Any], list[Any], list[Any]]
"""A run's steps, seconds and mean returns, as :func:`_series` gives them."""


def _drawn_once(runs: Sequence[str | Path], groups: Sequence[str] | None) -> tuple[list[str | Path], list[str] | None]:
    """``runs`` (and their ``groups``) with each run dir once, however spelt: the repeats are warned of."""
    firsts = _first_of_each(runs)
    distinct = [i for i, first in enumerate(firsts) if first == i]
    for i, (run, j) in enumerate(zip(runs, firsts, strict=True)):  # (the repeats, each named with its first)
        if j != i:
            first = runs[j]
            log.warning("%s: given twice%s; drawn once", first, "" if str(run) == str(first) else f" (also as {run})")
    return [runs[i] for i in distinct], None if groups is None else [groups[i] for i in distinct]


def _left_out(loaded: list[tuple[Path, list[_Point] | None, dict[str, Any] | None, dict[str, Any]]]) -> set[Path]:
    """The runs that cannot be drawn (no metrics file, no mean return yet), each warned of; raises where no run
    can be drawn."""
    # Left out, with a warning, while another run can be plotted (`learner plot runs/*` may take in a
    # folder that is no run, or a run killed before its first update): no metrics file, or no mean return.
    missing = [run for run, rows, *_ in loaded if rows is None]
    empty = {
        run
        for run, rows, summary, _ in loaded
        if rows is not None and not rows and (summary or {}).get("final_return_mean") is None
    }
    if len(missing) + len(empty) == len(loaded):
        if len(loaded) == 1 and missing:
            raise FileNotFoundError(_no_metrics(missing[0]))
        parts = [f"no {rundir.METRICS} in {', '.join(map(str, missing))}"] if missing else []
        if empty:
            listed = ", ".join(str(run) for run, *_ in loaded if run in empty)
            parts.append(
                f"no mean return in {listed} (a run's {rundir.METRICS} has one per update once an episode has ended)"
            )
        raise ValueError(f"nothing to plot: {'; '.join(parts)}")
    for run in missing:
        log.warning("%s; left out of the plot", _no_metrics(run))
    for run in (run for run, *_ in loaded if run in empty):
        log.warning("%s: no mean return yet, left out of the plot", run)
    empty.update(missing)
    return empty


def _use_tab20(*axes: Any) -> None:
    """Colour the lines of ``axes`` from tab20, for more lines than matplotlib's 10 default colours."""
    import matplotlib
    from cycler import cycler  # (matplotlib's own dependency)

    # (tab20's dark shades first, then its light ones: neighbours in it are one hue, dark and light)
    colour_cycle = cycler(color=[matplotlib.colormaps["tab20"](k) for k in (*range(0, 20, 2), *range(1, 20, 2))])
    for ax in axes:
        ax.set_prop_cycle(colour_cycle)


def _thresholds(plotted: list[tuple[Path, dict[str, Any]]]) -> dict[float, set[str]]:
    """Each solved bar of the runs plotted, with the envs whose runs it is for (runs of one env may differ:
    --stop-at-return)."""
    thresholds: dict[float, set[str]] = {}
    for _, config in plotted:
        if config.get("solved_threshold") is not None:
            env = _env(config)
            thresholds.setdefault(float(config["solved_threshold"]), set()).update([env] if env else [])
    return thresholds


def _members(
    loaded: list[tuple[Path, list[_Point] | None, dict[str, Any] | None, dict[str, Any]]],
    groups: list[str] | None,
    series: dict[Path, _Series],
) -> dict[str, list[_Series]]:
    """Each group's runs' series, in the order the runs were given (none without ``groups``)."""
    members: dict[str, list[_Series]] = {}  # group -> its runs' series
    for i, (run, *_) in enumerate(loaded):
        if groups is not None and run in series:
            members.setdefault(groups[i], []).append(series[run])
    return members


@dataclasses.dataclass
class _Panels:
    """The plot's two panels (returns by steps, by time) as the runs are drawn on them: each group's colour,
    and whether a run's solved step has been marked."""

    by_steps: Any
    by_time: Any
    members: dict[str, list[_Series]]
    banded: set[str] = dataclasses.field(init=False)
    colours: dict[str, Any] = dataclasses.field(default_factory=dict)
    solved_any: bool = False
    evals_marked: bool = False

    def __post_init__(self) -> None:
        # Groups drawn as a mean and a band: of several runs that overlap (in steps) over 2 points or more.
        self.banded = {
            g
            for g, curves in self.members.items()
            if len(curves) > 1 and _common_grid([(c[0], c[2]) for c in curves]).size > 1
        }

    def draw_run(
        self, series: _Series, name: str, summary: dict[str, Any] | None, env: str | None, group: str | None
    ) -> None:
        """Draw one run's returns on both panels (faint in a banded group), its solved step marked."""
        by_steps, by_time, colours, banded, members = (
            self.by_steps,
            self.by_time,
            self.colours,
            self.banded,
            self.members,
        )
        steps, seconds, returns = series
        # A line needs two points: a run with one (its first update, or a summary alone) gets a dot.
        marker = "o" if len(steps) == 1 else None
        if group is None:
            (line,) = by_steps.plot(steps, returns, label=_label(name, summary, env), marker=marker)
        else:
            if group in colours:
                (line,) = by_steps.plot(steps, returns, color=colours[group], linewidth=1, marker=marker)
            else:
                label = group if env is None else _with_env(group, env)
                if group in banded:
                    label += f" ({len(members[group])} runs: mean, range shaded)"
                elif len(members[group]) > 1:
                    label += f" ({len(members[group])} runs, not overlapping: no mean)"
                (line,) = by_steps.plot(steps, returns, linewidth=1, marker=marker)
                colours[group] = line.get_color()
                # (its legend entry: a line as the group's mean is drawn, bold for a banded group)
                by_steps.plot([], [], color=colours[group], linewidth=2 if group in banded else 1, label=label)
            if group in banded:
                line.set_alpha(0.35)
        by_time.plot(
            seconds,
            returns,
            color=line.get_color(),
            linewidth=line.get_linewidth(),
            marker=marker,
            alpha=line.get_alpha(),
        )
        if summary and summary.get("solved_at_step") is not None:
            self.solved_any = True
            by_steps.axvline(summary["solved_at_step"], color=line.get_color(), linestyle=":", linewidth=1)
            by_time.axvline(summary["solved_at_seconds"], color=line.get_color(), linestyle=":", linewidth=1)

    def draw_evals(self, evals: tuple[list[float], list[float]]) -> None:
        """Mark the evaluations (--eval-every: their steps and mean returns) of the run drawn last on the steps
        panel, in its colour; one legend entry says what the marks are."""
        steps, returns = evals
        if not steps:
            return
        colour = self.by_steps.get_lines()[-1].get_color()
        self.by_steps.plot(steps, returns, linestyle="none", marker="x", markersize=5, color=colour)
        if not self.evals_marked:
            self.evals_marked = True
            self.by_steps.plot([], [], linestyle="none", marker="x", color="0.3", label="evaluations (--eval-every)")

    def draw_bands(self) -> None:
        """Draw each banded group's mean and range on both panels."""
        for group in self.banded:
            for ax, x in ((self.by_steps, 0), (self.by_time, 1)):
                _draw_band(ax, [(curve[x], curve[2]) for curve in self.members[group]], self.colours[group])

    def draw_thresholds(self, thresholds: dict[float, set[str]]) -> None:
        """Draw each solved bar (a dashed line) on both panels, labelled with the envs it is for."""
        # One grey shade per bar (up to 4), so that bars of different envs tell apart.
        shades = ["grey", "black", "silver", "dimgrey"]
        for k, threshold in enumerate(sorted(thresholds)):
            whose = f" ({', '.join(sorted(thresholds[threshold]))})" if thresholds[threshold] else ""
            style = {"color": shades[k % len(shades)], "linestyle": "--", "linewidth": 1}
            self.by_steps.axhline(threshold, label=f"solved{whose}: mean return >= {threshold:g}", **style)
            self.by_time.axhline(threshold, **style)


def _labels_and_legend(fig: Any, by_steps: Any, by_time: Any, *, solved_any: bool, one_run: bool) -> float:
    """Label the axes and put the legend below them, the figure made taller for it: the legend's share of its
    height."""
    by_steps.set_xlabel("env steps")
    by_time.set_xlabel("wall time (s)")
    by_steps.set_ylabel("mean return, last 20 episodes\n(all of them until 20 have ended)")
    for ax in (by_steps, by_time):
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)  # (runs start at 0: a short run's few points are not spread over the width)
    handles, labels = by_steps.get_legend_handles_labels()
    if solved_any:
        (marker,) = by_steps.plot([], [], color="grey", linestyle=":", linewidth=1)
        handles.append(marker)
        labels.append("where the run solved it" if one_run else "where each run solved it")
    # Below the axes, where it hides no line.
    # (one column where a label is long, as a group's of many differences: two would run off the figure)
    columns = (1 if max(map(len, labels), default=0) > 70 else min(2, len(labels))) or 1
    # (a label longer than the figure is wide, as a group's of many differences between runs of different
    # envs, is wrapped: unwrapped, it ran off both sides, and the entries of the others with it)
    # (a lone surrogate, as in a run dir's name of bytes that are not UTF-8, escaped: matplotlib's text raised
    # TypeError on it)
    labels = [
        textwrap.fill(escape_surrogates(label), LABEL_WIDTH, break_long_words=False, break_on_hyphens=False)
        for label in labels
    ]
    legend_rows = -(-len(labels) // columns) if columns > 1 else sum(label.count("\n") + 1 for label in labels)
    height = 4.2 + 0.18 * legend_rows
    fig.set_size_inches(11, height)
    legend_height = (0.1 + 0.17 * legend_rows) / height
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    return legend_height


def _save(fig: Any, output: str | Path, output_name: str | None) -> Path:
    """Write ``fig`` to ``output`` (``.png`` added to a name without a suffix), atomically: the path written."""
    output = Path(output)
    if not output.suffix:  # (as matplotlib does for a name without one, and so the path returned is the file's)
        output = output.with_name(f"{output.name}.png")
    try:
        # Atomically: a full disk or a killed process leaves the previous plot, never a 0-byte or half PNG.
        rundir.atomic_write(output, lambda f: fig.savefig(f, format=output.suffix[1:].lower(), dpi=100))
    except OSError as err:
        if output_name is None:  # (learner plot without -o, or train's own plot: no option to name)
            raise PlotWriteError(f"cannot write the plot {output} ({os_reason(err)})") from None
        raise PlotWriteError(
            f"{output_name}: expected a path where the plot can be written, got {output} ({os_reason(err)})"
        ) from None
    return output
