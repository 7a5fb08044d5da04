"""What ``learner plot`` draws: axes from 0, a colour per run past matplotlib's 10, and labels that
say what a point is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from matplotlib.colors import to_hex

from learner import rundir
from learner.plot import config_groups, plot_runs


def _run(folder: Path, points: int, solved_at: int | None = None) -> Path:
    folder.mkdir()
    rows = [
        {"update": i, "global_step": 1000 + 16 * i, "seconds": 2.0 + 0.1 * i, "episodic_return_mean": 10.0 * i}
        for i in range(1, points + 1)
    ]
    rundir.rewrite_jsonl(folder / rundir.METRICS, rows)
    rundir.write_json(folder / rundir.CONFIG, {"args": {"env": "CartPole-v1"}, "solved_threshold": 475.0})
    if solved_at is not None:
        summary = {
            "total_steps": rows[-1]["global_step"],
            "seconds": rows[-1]["seconds"],
            "final_return_mean": rows[-1]["episodic_return_mean"],
            "solved_at_step": solved_at,
            "solved_at_seconds": 2.5,
        }
        rundir.write_json(folder / rundir.SUMMARY, summary)
    return folder


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures plot_runs saves, as they were when saved (it closes them after)."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    save = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def test_a_short_run_is_drawn_from_zero_with_labels_that_say_what_a_point_is(
    tmp_path: Path, figures: list[Any]
) -> None:
    """A run stopped at its first update was drawn over 1,016-1,017 steps and 2.1-2.1 s: both axes
    now start at 0. The y label says what a point is before 20 episodes have ended; the solve marker's
    legend entry speaks of the one run."""
    plot_runs([_run(tmp_path / "one", 1, solved_at=1016)], tmp_path / "one.png")
    (figure,) = figures
    by_steps, by_time = figure.axes
    assert by_steps.get_xlim()[0] == 0 and by_time.get_xlim()[0] == 0
    assert by_steps.get_xlim()[1] > 1016 and by_time.get_xlim()[1] > 2.1
    assert by_steps.get_ylabel() == "mean return, last 20 episodes\n(all of them until 20 have ended)"
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels[-1] == "where the run solved it"


def test_more_runs_than_the_default_colours_each_get_their_own(tmp_path: Path, figures: list[Any]) -> None:
    runs = [_run(tmp_path / f"run{i:02d}", 3, solved_at=1032) for i in range(12)]
    plot_runs(runs, tmp_path / "many.png")
    (figure,) = figures
    colours = [line.get_color() for line in figure.axes[0].get_lines() if line.get_linestyle() == "-"]
    assert len(colours) == 12 and len({to_hex(c) for c in colours}) == 12
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels[-1] == "where each run solved it"
    # Ten or fewer keep matplotlib's usual colours.
    figures.clear()
    plot_runs(runs[:3], tmp_path / "three.png")
    colours = [line.get_color() for line in figures[0].axes[0].get_lines() if line.get_linestyle() == "-"]
    assert [to_hex(c) for c in colours] == ["#1f77b4", "#ff7f0e", "#2ca02c"]


def test_a_long_run_is_drawn_from_each_stretch_s_lowest_and_highest_point_and_a_short_one_whole(
    tmp_path: Path, figures: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """learner plot (and every run, at its end) read a run's whole metrics.jsonl into memory: 884 MB for 2 h of
    CartPole (100,000 rows). It keeps what it draws, at most plot.MAX_POINTS points (10,000; 100 here) of a run:
    the first and last, and the lowest and highest of each stretch (a spike of one update shows); a run of no
    more is drawn from every row, as before."""
    from learner import plot

    monkeypatch.setattr(plot, "MAX_POINTS", 100)
    spike, dip = 537, 811
    for name, updates in (("long", 1000), ("short", 100)):
        (tmp_path / name).mkdir()
        rows = [
            {"update": i, "global_step": 16 * i, "seconds": 0.5 * i, "episodic_return_mean": float(i % 7)}
            for i in range(1, updates + 1)
        ]
        if name == "long":
            rows[spike]["episodic_return_mean"], rows[dip]["episodic_return_mean"] = 500.0, -500.0
        rundir.rewrite_jsonl(tmp_path / name / rundir.METRICS, rows)
        figures.clear()
        plot_runs([tmp_path / name], tmp_path / f"{name}.png")
        by_steps, by_time = figures[0].axes
        (line,) = by_steps.get_lines()
        points = list(zip(line.get_xdata(), by_time.get_lines()[0].get_xdata(), line.get_ydata(), strict=True))
        every = [(r["global_step"], r["seconds"], r["episodic_return_mean"]) for r in rows]
        if name == "short":
            assert points == every
            continue
        assert 25 <= len(points) <= 100, len(points)
        assert set(points) <= set(every) and points == sorted(points)
        assert points[0] == every[0] and points[-1] == every[-1]
        assert every[spike] in points and every[dip] in points
        # (each stretch of consecutive rows: its lowest and highest, 0 and 6 but where the spike or dip is)
        assert {y for _, _, y in points[1:-1]} == {0.0, 6.0, 500.0, -500.0}


@pytest.mark.needs_torch
def test_of_a_row_as_train_writes_it_only_what_is_drawn_is_read_as_json_would() -> None:
    """A run's rows, 2 KB each, are not parsed whole to draw three numbers of each (2.6 s for 100,000 rows, at
    the end of every session); read so, they are what json.loads reads, and a line that is no row as train
    writes it (an older version's, one cut short) is parsed whole, as before."""
    import json

    from learner.plot import _DRAWN, _drawn_of
    from learner.records import metrics_row
    from learner.update import UpdateResult

    result = UpdateResult(0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.5, batch_size=16, seconds=0.01)
    timing = dict.fromkeys(("seconds", "sps", "sps_update", "transitions_per_s", "other_seconds"), 1.5)
    info: dict[str, Any] = dict.fromkeys(("env_steps_lost", "env_errors", "envs_unavailable", "episodes_cut"), 0)
    info.update(episodes=3, num_envs=2, learning_rate=1e-3, clip_coef=0.2, rollout_seconds=0.01, fleet={})
    drawn = ("global_step", "seconds", "episodic_return_mean")
    for step, returned in ((16, None), (32, -1.25e-07), (48, 21)):
        info.update(global_step=step, episodic_return_mean=returned, episodic_length_mean=returned)
        line = json.dumps(rundir.jsonable(metrics_row(step // 16, timing, result, info))) + "\n"
        assert _DRAWN.match(line)  # (read as train writes it)
        whole = json.loads(line)
        assert _drawn_of(line) == {key: whole[key] for key in drawn}
        assert [type(value) for value in _drawn_of(line).values()] == [type(whole[key]) for key in drawn]
        with pytest.raises(json.JSONDecodeError):
            _drawn_of(line[:-200])
    older = '{"global_step": 5, "seconds": 1.0, "episodic_return_mean": 2.0, "update": 1}\n'
    assert _drawn_of(older) == json.loads(older)


def _configured(folder: Path, seed: int, offset: float, **ppo: Any) -> Path:
    """A run of CartPole with PPO settings ``ppo`` (over a base), its returns ``offset`` above a ramp."""
    folder.mkdir()
    rows = [
        {"update": i, "global_step": 100 * i + seed, "seconds": 0.5 * i, "episodic_return_mean": 10.0 * i + offset}
        for i in range(1, 6)
    ]
    rundir.rewrite_jsonl(folder / rundir.METRICS, rows)
    config = {
        "args": {"env": "CartPole-v1", "seed": seed, "run_dir": str(folder), "backend": "remote", "torch_threads": 0},
        "envs": {"env_id": "CartPole-v1", "num_envs": 8, "addresses": ["a:1", "b:2"]},
        "ppo": {"preset": "classic", "total_timesteps": 1000 * seed, "gamma": 0.98, **ppo},
        "device": "cpu",
        "policy": "MLP 64,64",
    }
    rundir.write_json(folder / rundir.CONFIG, config)
    return folder


def test_runs_that_differ_only_in_seed_are_one_group_named_by_what_sets_it_apart(tmp_path: Path) -> None:
    base = [_configured(tmp_path / f"base{seed}", seed, 0.0) for seed in (1, 2, 3)]
    other = [_configured(tmp_path / f"other{seed}", seed, 5.0, gamma=0.99) for seed in (1, 2)]
    bare = tmp_path / "bare"
    bare.mkdir()
    assert config_groups([*base, *other, bare]) == [*["gamma=0.98"] * 3, *["gamma=0.99"] * 2, "bare"]
    assert config_groups(base) == ["CartPole-v1"] * 3  # (seeds, budgets and run dirs apart: one group)


def test_a_sweep_s_sampled_values_are_named_to_four_digits_unless_that_would_merge_two(tmp_path: Path) -> None:
    sampled = [_configured(tmp_path / f"lr{i}", 1, 0.0, learning_rate=lr) for i, lr in enumerate((0.0016005454, 3e-4))]
    assert config_groups(sampled) == ["learning_rate=0.001601", "learning_rate=0.0003"]
    close = [
        _configured(tmp_path / f"close{i}", 1, 0.0, learning_rate=lr) for i, lr in enumerate((0.00123451, 0.00123452))
    ]
    assert config_groups(close) == ["learning_rate=0.00123451", "learning_rate=0.00123452"]


def test_a_group_of_runs_is_drawn_as_their_mean_with_their_range_shaded(tmp_path: Path, figures: list[Any]) -> None:
    runs = [_configured(tmp_path / f"s{seed}", seed, 10.0 * seed) for seed in (1, 2, 3)]
    runs.append(_configured(tmp_path / "alone", 1, 0.0, gamma=0.99))
    plot_runs(runs, tmp_path / "groups.png", groups=config_groups(runs))
    (figure,) = figures
    by_steps, by_time = figure.axes
    for ax in (by_steps, by_time):
        bold = [line for line in ax.get_lines() if line.get_linewidth() == 2 and len(line.get_xdata())]
        (mean,) = bold  # (the group of one is drawn as its run alone)
        # Where all three have points (x from 103 to 501 steps): the mean of returns 10 i + 10, + 20, + 30.
        assert mean.get_ydata()[0] == pytest.approx(30.0, abs=1.0) and mean.get_ydata()[-1] == pytest.approx(
            70.0, abs=1.0
        )
        assert len(ax.collections) == 1  # the shaded range, of the group of three only
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels[:2] == ["gamma=0.98 (3 runs: mean, range shaded)", "gamma=0.99"]


def test_learner_plot_by_config_groups_the_seeds(tmp_path: Path, figures: list[Any]) -> None:
    from learner.cli import main

    runs = [str(_configured(tmp_path / f"s{seed}", seed, 0.0)) for seed in (1, 2)]
    runs.append(str(_configured(tmp_path / "wide", 1, 0.0, gamma=0.9)))
    assert main(["plot", *runs, "--by-config", "-o", str(tmp_path / "by.png")]) == 0
    assert main(["plot", *runs, "-o", str(tmp_path / "each.png")]) == 0
    by_config, each = ([text.get_text() for text in figure.legends[0].get_texts()] for figure in figures)
    assert by_config[:2] == ["gamma=0.98 (2 runs: mean, range shaded)", "gamma=0.9"]
    assert [label.split(" ")[0] for label in each[:3]] == ["s1", "s2", "wide"]


def test_by_config_takes_a_folder_whose_config_json_is_no_run_s_as_one_without(
    tmp_path: Path, figures: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A config.json without an ``args`` object (a folder of something else, taken in by `learner plot
    runs/*`) is no run's: that folder is a group of its own (with metrics) or left out with a warning
    (without), as a folder without one is, not an AttributeError."""
    from learner.cli import main

    runs = [_configured(tmp_path / f"s{seed}", seed, 0.0) for seed in (1, 2)]
    listed, other, empty = tmp_path / "listed", tmp_path / "other", tmp_path / "empty"
    for folder, config in ((listed, [1, 2]), (other, {"args": "x", "my": "settings"}), (empty, [1, 2])):
        (_run(folder, 3) if folder != empty else folder).mkdir(exist_ok=True)
        rundir.write_json(folder / rundir.CONFIG, config)
    assert config_groups([*runs, listed, other]) == ["CartPole-v1", "CartPole-v1", "listed", "other"]
    assert main(["plot", *map(str, runs), str(empty), str(listed), "--by-config", "-o", str(tmp_path / "g.png")]) == 0
    assert f"{empty}: expected a run dir with {rundir.METRICS}, found none; left out of the plot" in caplog.text
    labels = [text.get_text() for text in figures[0].legends[0].get_texts()]
    assert labels[:2] == ["CartPole-v1 (2 runs: mean, range shaded)", "listed"]


@pytest.mark.parametrize("name", [rundir.CONFIG, rundir.SUMMARY])
def test_a_run_s_json_file_that_cannot_be_read_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """Named in a warning, and the run plotted as one without it (its metrics are whole: it was an error,
    which in `learner plot runs/*` left every other run unplotted too)."""
    from learner.cli import main

    run = _run(tmp_path / "r", 3, solved_at=1000)
    (run / name).write_text('{"args": ')
    argv = ["plot", str(run), "-o", str(tmp_path / "p.png")]
    assert main([*argv, "--by-config"] if name == rundir.CONFIG else argv) == 0
    err = capsys.readouterr().err
    assert f"{run / name}: expected a run's JSON file, but it cannot be read (Expecting " in caplog.text
    assert caplog.text.count("cannot be read") == 1 and "the run is plotted as one without it" in caplog.text
    assert "Traceback" not in err and (tmp_path / "p.png").is_file()


def test_runs_whose_budget_anneals_their_learning_rate_differently_are_not_one_group(tmp_path: Path) -> None:
    """With the learning rate (or the clip) annealed over --total-timesteps, the budget changes how a
    run learns: a run resumed with a larger one is another configuration; without annealing, it is not."""
    annealed = [_configured(tmp_path / f"a{seed}", seed, 0.0, anneal_lr=True) for seed in (1, 2)]
    assert config_groups(annealed) == ["total_timesteps=1000", "total_timesteps=2000"]
    flat = [_configured(tmp_path / f"f{seed}", seed, 0.0, anneal_lr=False, anneal_clip=False) for seed in (1, 2)]
    assert config_groups(flat) == ["CartPole-v1"] * 2


def test_a_group_whose_runs_do_not_overlap_has_no_mean_and_says_so(tmp_path: Path, figures: list[Any]) -> None:
    early, late = _configured(tmp_path / "early", 1, 0.0), _configured(tmp_path / "late", 2, 0.0)
    rows = rundir.read_jsonl(late / rundir.METRICS)
    rundir.rewrite_jsonl(late / rundir.METRICS, [{**r, "global_step": r["global_step"] + 10_000} for r in rows])
    plot_runs([early, late], tmp_path / "apart.png", groups=["g", "g"])
    (figure,) = figures
    lines = [line for line in figure.axes[0].get_lines() if len(line.get_xdata())]
    assert [line.get_linewidth() for line in lines] == [1, 1] and {line.get_alpha() for line in lines} == {None}
    assert not figure.axes[0].collections
    assert figure.legends[0].get_texts()[0].get_text() == "g (2 runs, not overlapping: no mean)"


def test_by_config_warns_of_one_seed_twice_in_a_group(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runs = [_configured(tmp_path / "a1", 1, 0.0), _configured(tmp_path / "a2", 2, 0.0)]
    copy = _configured(tmp_path / "copy", 1, 0.0)
    with caplog.at_level("WARNING", logger="learner.plot"):
        config_groups(runs)
        assert not caplog.records
        config_groups([*runs, copy])
    assert [r.getMessage() for r in caplog.records] == [
        f"{runs[0]} and {copy}: the same configuration and seed (1), so the same run twice in one mean (runs are "
        "deterministic per seed); leave one out"
    ]
    threads = _configured(tmp_path / "t", 3, 0.0)
    config = rundir.read_json(threads / rundir.CONFIG)
    rundir.write_json(threads / rundir.CONFIG, {**config, "args": {**config["args"], "torch_threads": 4}})
    assert config_groups([*runs, threads]) == ["torch_threads=0", "torch_threads=0", "torch_threads=4"]


def test_by_config_takes_what_an_older_run_did_not_record_as_the_others_share_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs of one configuration before and after a version that records more (config.json's envs,
    policy; options added since, which the older run ran as their default does): one group, and one seed
    twice is still seen."""
    new = [_configured(tmp_path / f"new{seed}", seed, 0.0) for seed in (1, 2)]
    for run in new:
        config = rundir.read_json(run / rundir.CONFIG)
        rundir.write_json(run / rundir.CONFIG, {**config, "args": {**config["args"], "overlap_update": False}})
    old = _configured(tmp_path / "old", 1, 0.0)
    config = rundir.read_json(old / rundir.CONFIG)
    del config["envs"], config["policy"], config["args"]["torch_threads"]
    rundir.write_json(old / rundir.CONFIG, config)
    with caplog.at_level("WARNING", logger="learner.plot"):
        assert config_groups([*new, old]) == ["CartPole-v1"] * 3
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"{new[0]} and {old}"]
    # Where the runs that record it differ, an older run's is unknown: "?".
    other = _configured(tmp_path / "other", 3, 0.0)
    config = rundir.read_json(other / rundir.CONFIG)
    rundir.write_json(other / rundir.CONFIG, {**config, "envs": {**config["envs"], "num_envs": 4}})
    assert config_groups([*new, old, other]) == ["num_envs=8", "num_envs=8", "num_envs=?", "num_envs=4"]
    # An option the older run lacks is its default, not the others' value: a new run with it on differs.
    on = _configured(tmp_path / "on", 1, 0.0)
    config = rundir.read_json(on / rundir.CONFIG)
    rundir.write_json(on / rundir.CONFIG, {**config, "args": {**config["args"], "overlap_update": True}})
    assert config_groups([old, on]) == ["overlap_update=false", "overlap_update=true"]


def test_plotting_leaves_matplotlib_s_backend_and_pyplot_alone(tmp_path: Path) -> None:
    """A notebook's ``%matplotlib inline`` figures still show after train() (which plots) or plot_runs: no
    backend switch, and pyplot not imported where the caller had not (in a process of its own: here,
    other tests import pyplot)."""
    run = _run(tmp_path / "a", 3, solved_at=1020)
    code = f"""
        import sys, matplotlib
        matplotlib.use("svg")
        from learner.plot import plot_runs
        plot_runs([{str(run)!r}], {str(tmp_path / "out.png")!r})
        print("matplotlib.pyplot" in sys.modules, matplotlib.get_backend())
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "svg"]
    assert (tmp_path / "out.png").read_bytes().startswith(b"\x89PNG")


def test_runs_of_one_folder_name_are_told_apart_in_the_legend(
    tmp_path: Path, figures: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Both were "cp"; a run plotted as "." was "." in the legend.)"""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    runs = [_run(tmp_path / "a" / "cp", 3), _run(tmp_path / "b" / "cp", 3), _run(tmp_path / "other", 3)]
    plot_runs(runs, tmp_path / "same.png")
    assert [t.get_text() for t in figures[0].legends[0].get_texts()][:3] == ["a/cp", "b/cp", "other"]
    figures.clear()
    monkeypatch.chdir(runs[2])
    plot_runs([Path(".")], tmp_path / "dot.png")
    assert figures[0].legends[0].get_texts()[0].get_text() == "other"
    figures.clear()
    (tmp_path / "latest").symlink_to(runs[2])  # (a link is named as the link, not its target)
    plot_runs([tmp_path / "latest"], tmp_path / "link.png")
    assert figures[0].legends[0].get_texts()[0].get_text() == "latest"


def test_lines_of_a_metrics_file_that_are_no_update_s_are_left_out_saying_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """(A line that was JSON but no object was an AttributeError, a row without seconds a KeyError, and
    bytes that are no UTF-8 an error naming no file.)"""
    from learner.cli import main

    run = _run(tmp_path / "r", 3)
    with open(run / rundir.METRICS, "a") as f:
        f.write('[1, 2]\n{"global_step": 5000, "episodic_return_mean": 3.0}\n')
    plot_runs([run], tmp_path / "p.png")
    assert f"{run / rundir.METRICS}: 2 line(s) without global_step, seconds, episodic_return_mean left out" in (
        caplog.text
    )
    # Bytes that are no UTF-8 (were an error for the whole file): their lines, in a value or not, left out.
    good = (run / rundir.METRICS).read_bytes().splitlines(keepends=True)[:3]
    bad = [b'{"global_step": 1, "seconds": 1.0, "episodic_return_mean": "\xff"}\n', b"\xff\xfe{}\n"]
    (run / rundir.METRICS).write_bytes(b"".join([*good, *bad]))
    caplog.clear()
    assert main(["plot", str(run), "-o", str(tmp_path / "q.png")]) == 0
    assert f"{run / rundir.METRICS}: 2 line(s) without global_step, seconds, episodic_return_mean left out" in (
        caplog.text
    )
    assert "Traceback" not in capsys.readouterr().err


def test_a_run_with_a_damaged_file_does_not_stop_the_plot_of_the_others(
    tmp_path: Path, figures: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """`learner plot runs/*`: one run's summary.json or config.json that is no JSON, or a metrics.jsonl of
    bytes that are no UTF-8, failed the whole plot. Each is named; the run is plotted without that file, or
    left out where nothing of it is left to plot."""
    from learner.cli import main

    good = _run(tmp_path / "good", 3)
    badsum, badconf = (_run(tmp_path / name, 3, solved_at=1000) for name in ("badsum", "badconf"))
    garbage = _run(tmp_path / "garbage", 3)
    (badsum / rundir.SUMMARY).write_text("{")
    (badconf / rundir.CONFIG).write_bytes(b"\xff{not json")
    (garbage / rundir.METRICS).write_bytes(b'\x00\xff\xfe garbage\n[1,2]\n{"global_step": "x", "seconds": 1}\n')
    runs = [str(p) for p in (good, badsum, badconf, garbage)]
    for by_config in ([], ["--by-config"]):
        caplog.clear()
        assert main(["plot", *runs, *by_config, "-o", str(tmp_path / "all.png")]) == 0
        for path in (badsum / rundir.SUMMARY, badconf / rundir.CONFIG):
            assert caplog.text.count(f"{path}: expected a run's JSON file, but it cannot be read") == 1, caplog.text
        assert f"{garbage / rundir.METRICS}: 3 line(s) without " in caplog.text
        assert f"{garbage}: no mean return yet, left out of the plot" in caplog.text
    labels = [text.get_text() for text in figures[0].legends[0].get_texts()]
    assert [label.split(" ")[0] for label in labels[:3]] == ["good", "badsum", "badconf"], labels


def test_a_legend_of_runs_of_different_envs_fits_the_figure_each_env_first(tmp_path: Path, figures: list[Any]) -> None:
    """Groups of runs that differ in env and in much else had labels of 270 characters on one line, wider
    than the figure: the legend ran off both sides, the other entries with it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    many = {f"setting_{k}": k for k in range(12)}
    cartpole = _configured(tmp_path / "cartpole", 1, 0.0, **many)
    pendulum = _configured(tmp_path / "pendulum", 1, 0.0, **{key: value + 1 for key, value in many.items()})
    config = rundir.read_json(pendulum / rundir.CONFIG)
    config["args"]["env"] = config["envs"]["env_id"] = "Pendulum-v1"
    rundir.write_json(pendulum / rundir.CONFIG, config)
    runs = [cartpole, pendulum, _run(tmp_path / "unknown", 3)]
    (runs[2] / rundir.CONFIG).unlink()  # (a group of its own, named after its folder)
    plot_runs(runs, tmp_path / "p.png", groups=config_groups(runs))
    (figure,) = figures
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels[0].startswith("CartPole-v1: setting_0=0, ") and labels[1].startswith("Pendulum-v1: "), labels
    assert "[CartPole-v1]" not in labels[0] and labels[2] == "unknown", labels
    assert max(len(line) for label in labels for line in label.splitlines()) <= 100, labels
    canvas = FigureCanvasAgg(figure)
    legend = figure.legends[0].get_window_extent(canvas.get_renderer())
    assert legend.x0 >= 0 and legend.x1 <= figure.bbox.width and legend.y0 >= 0, (legend, figure.bbox)


def test_a_run_s_file_given_for_its_run_dir_is_named_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from learner.cli import main

    run = _run(tmp_path / "r", 3)
    assert main(["plot", str(run / rundir.METRICS), "-o", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert f"learner plot: error: {run / rundir.METRICS}: expected a run dir, got a file (pass its run dir, {run})" in (
        err
    ), err


def test_a_run_dir_given_twice_is_drawn_once_with_a_warning(
    tmp_path: Path, figures: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`learner plot runs/cp runs/cp` (or `runs/cp ./runs/cp/`, a link to it) drew two identical lines, one
    over the other, silently; --by-config counted it twice in its group's mean, and warned of it as of a
    copy of the run. Now it is drawn once, with a warning naming it (and how else it was spelt)."""
    from learner.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    cp = _configured(tmp_path / "runs" / "cp", 1, 0.0)
    _configured(tmp_path / "runs" / "other", 2, 5.0)
    (tmp_path / "latest").symlink_to(cp)
    with caplog.at_level("WARNING", logger="learner.plot"):
        assert main(["plot", "runs/cp", "runs/other", "runs/cp", "./runs/cp/", "latest", "-o", "each.png"]) == 0
        assert main(["plot", "runs/cp", "runs/other", "./runs/cp/", "--by-config", "-o", "by.png"]) == 0
    each, by_config = figures
    solid = [line for line in each.axes[0].get_lines() if line.get_linestyle() == "-" and len(line.get_xdata())]
    assert len(solid) == 2, [line.get_label() for line in solid]
    assert [text.get_text() for text in each.legends[0].get_texts()][:2] == ["cp", "other"]
    assert [r.getMessage() for r in caplog.records if r.name == "learner.plot"] == [
        "runs/cp: given twice; drawn once",
        "runs/cp: given twice (also as ./runs/cp/); drawn once",
        "runs/cp: given twice (also as latest); drawn once",
        "runs/cp: given twice (also as ./runs/cp/); drawn once",  # (--by-config: no "same seed" warning)
    ]
    bold = [line for line in by_config.axes[0].get_lines() if line.get_linewidth() == 2 and len(line.get_xdata())]
    (mean,) = bold  # (cp and other, one configuration: their mean, cp counted once; twice, it was 51.6)
    assert mean.get_ydata()[-1] == pytest.approx((50.0 + 54.9) / 2, abs=0.01)  # (at step 501: other's, interpolated)
    assert config_groups(["runs/cp", "./runs/cp/"]) == ["CartPole-v1", "CartPole-v1"]  # (one name per run given)


def test_a_loop_of_links_among_the_run_dirs_is_no_run_dir_not_a_traceback(
    tmp_path: Path, figures: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run dirs are compared with their links followed; a loop of links (which `runs/*` can pick up)
    raised RuntimeError from Path.resolve(), a traceback, where it was said to be no run dir."""
    from learner.cli import main

    monkeypatch.chdir(tmp_path)
    _configured(tmp_path / "real", 1, 0.0)
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    status = main(["plot", "real", "loop1", "-o", "p.png"])
    err = capsys.readouterr().err
    assert status == 1 and "loop1: no such run dir" in err and "Traceback" not in err, err


def test_a_run_dir_named_in_bytes_that_are_not_utf8_is_plotted_its_name_escaped(
    tmp_path: Path, figures: list[Any]
) -> None:
    """A folder named b"caf\\xe9" (Latin-1), as Python names it ('caf\\udce9'): matplotlib's text raised TypeError on
    its label (learner train's plot at the end, after the summary, and learner plot); --title likewise."""
    run = _run(tmp_path / os.fsdecode(b"caf\xe9"), 3)
    plot_runs([run], tmp_path / "out.png", title=os.fsdecode(b"r\xe9sum\xe9"))
    (figure,) = figures
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels[0] == "caf\\udce9", labels
    assert figure._suptitle.get_text() == "r\\udce9sum\\udce9" and (tmp_path / "out.png").stat().st_size > 0
