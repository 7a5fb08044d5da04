"""What a run reports, update by update and at its end: metrics.jsonl, TensorBoard, W&B, live metrics, the
progress bar or lines (:class:`Recorder`), summary.json, returns.png."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch

from env_server.protocol import escape_surrogates
from env_server.tuning import to_devnull
from learner import rundir
from learner.errors import RunDirWriteError
from learner.fleetwatch import ReplicaTotals, written_row
from learner.progress import (
    bar_postfix,
    eval_note,
    eval_running_note,
    fleet_down_note,
    fleet_note,
    progress_line,
    video_running_note,
    waiting_line,
    widget_total,
)
from learner.resume import Counters
from learner.rundir import writing
from learner.stats import REPLICAS, mean_of
from learner.update import UpdateResult

if TYPE_CHECKING:
    from learner.live_metrics import LearnerMetrics
    from learner.tracking import WandbRun

__all__ = [
    "EventsWriter",
    "Recorder",
    "build_summary",
    "fault_tags_started",
    "mean_or_none",
    "metrics_row",
    "plot_at_exit",
    "tagged_values",
    "write_tensorboard",
]

log = logging.getLogger(__name__)


def metrics_row(
    update: int,
    timing: dict[str, float],
    result: UpdateResult,
    rollout_info: dict[str, Any],
) -> dict[str, Any]:
    """metrics.jsonl's row of an update: ``timing`` (seconds, sps, sps_update, other_seconds) as of its end,
    the run as of the end of the rollout it learned from (``rollout_info``), and its ``result``."""
    return {
        "update": update,
        "global_step": rollout_info["global_step"],
        "seconds": round(timing["seconds"], 4),
        "sps": round(timing["sps"], 1),
        "sps_update": round(timing["sps_update"], 1),
        "transitions_per_s": round(timing["transitions_per_s"], 1),
        "episodic_return_mean": rollout_info["episodic_return_mean"],
        "episodic_length_mean": rollout_info["episodic_length_mean"],
        "episodes": rollout_info["episodes"],
        "learning_rate": rollout_info["learning_rate"],
        "clip_coef": rollout_info["clip_coef"],
        "value_loss": result.value_loss,
        "policy_loss": result.policy_loss,
        "entropy": result.entropy,
        "old_approx_kl": result.old_approx_kl,
        "approx_kl": result.approx_kl,
        "clipfrac": result.clipfrac,
        "explained_variance": result.explained_variance,
        "num_envs": rollout_info["num_envs"],
        "batch_size": result.batch_size,
        "rollout_seconds": rollout_info["rollout_seconds"],
        "update_seconds": round(result.seconds, 5),
        "other_seconds": round(timing["other_seconds"], 5),
        # Fault tolerance, this update: env steps that were no transition, envs unavailable
        # at its end, episodes cut short; and servers lost and back, from the fleet's
        # counters (summary.json has the run's totals), and per env server its statistics.
        "env_steps_lost": rollout_info["env_steps_lost"],
        "env_errors": rollout_info["env_errors"],
        "envs_unavailable": rollout_info["envs_unavailable"],
        "episodes_cut": rollout_info["episodes_cut"],
        **rollout_info["fleet"],
    }


class EventsWriter:
    """A run's TensorBoard event file (torch's SummaryWriter): a write that fails (a full disk, a run dir
    turned read-only) ends the run with :func:`rundir.cannot_write`'s one line, as every run-dir write does.

    The writer writes from a thread of its own, which keeps its error for the next write to raise;
    Python would print that thread's traceback too (:class:`_QuietEventsThread`)."""

    def __init__(self, run_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._hook = _QuietEventsThread()
        self.path = run_dir / "events.out.tfevents.*"  # (named once SummaryWriter made it)
        try:
            with rundir.writing(self.path):
                self._writer = SummaryWriter(str(run_dir), purge_step=purge_step)
        except UnicodeEncodeError as err:  # (tensorboard's file system encodes the path as UTF-8)
            self._hook.close()
            raise RunDirWriteError(
                f"cannot write {escape_surrogates(str(self.path))}: TensorBoard takes only paths that are valid "
                "UTF-8, and the run dir's is not (a name of bytes in another encoding); pass --no-tensorboard, or "
                "give a --run-dir of UTF-8"
            ) from err
        except BaseException:
            self._hook.close()
            raise
        events = self._writer._get_file_writer().event_writer
        self.path = Path(getattr(events, "_file_name", self.path))
        self._failed = False
        try:
            self._sort_last(events)
        except BaseException:
            self.close()
            raise

    def _sort_last(self, events: Any) -> None:
        """Rename the new event file, if need be, so that its name sorts after the run dir's other event
        files': TensorBoard reads a run's files in name order, and a resumed run's purge of the events after
        its checkpoint (``purge_step``) applies to those read before it. The name's timestamp is the wall
        clock's, which may have been set back since an earlier session (or be behind that of the machine it
        ran on): its file, sorted first, was read first, and TensorBoard's data server then showed the run
        up to the killed session's last step only, the resumed part missing; EventAccumulator, the series
        out of order with the killed session's tail left in. The new name is tensorboard's own with the
        timestamp 1 past the latest (``events.out.tfevents.<time>.<host>.<pid>.<n>``)."""
        path = self.path
        others = [p.name for p in path.parent.glob("events.out.tfevents.*") if p.name != path.name]
        if not others or path.name > max(others):
            return
        ours = _EVENTS_NAME.fullmatch(path.name)
        stamps = [int(m.group(1)) for m in map(_EVENTS_NAME.fullmatch, [*others, path.name]) if m is not None]
        if ours is None:  # (a naming of another tensorboard version: left as it is)
            log.warning("TensorBoard: %s sorts before %s, read after it", path.name, max(others))
            return
        renamed = path.with_name(f"events.out.tfevents.{max(stamps) + 1:010d}{ours.group(2)}")
        # tensorboard's GFile opens the file by its name at each write (TensorFlow's keeps it open): none is
        # pending once flushed (its thread writes what this one queues), and the rest go to the new name.
        try:
            self._writer.flush()
            path.rename(renamed)
        except OSError as err:  # (a file system that refuses, Windows' with the file open: read out of order)
            log.warning("TensorBoard: could not rename %s, which sorts before %s: %s", path.name, max(others), err)
            return
        gfile: Any = getattr(events, "_general_file_writer", None)
        if isinstance(getattr(gfile, "filename", None), bytes):
            gfile.filename = bytes(renamed)
        events._file_name = str(renamed)
        self.path = renamed
        log.info(
            "TensorBoard: event file named %s, not %s: TensorBoard reads a run's event files in name order, and "
            "that name, from the wall clock, sorted before %s (the clock is behind that file's time, or in its second)",
            renamed.name,
            path.name,
            max(others),
        )

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with self._adding():
            self._writer.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        with self._adding():
            self._writer.add_text(tag, text, step)

    @contextlib.contextmanager
    def _adding(self) -> Iterator[None]:
        """A record added to the file (:meth:`add_scalar`, :meth:`add_text`): its OSError (the writer thread's,
        kept for the next write, or the call's own) ends the run with :func:`rundir.cannot_write`'s one line, and
        the writer is marked failed, so that :meth:`close` does not log that failure a second time. (Each adding
        method caught it and marked the writer by itself.)"""
        try:
            yield
        except OSError as err:
            self._failed = True
            raise rundir.cannot_write(self.path, err) from err

    def close(self) -> None:
        """Flush and close the file; a failure not raised already is logged (the run has ended)."""
        try:
            self._writer.close()
        except OSError as err:
            if not self._failed:
                log.error("%s", rundir.cannot_write(self.path, err))
        finally:
            self._hook.close()


_EVENTS_NAME = re.compile(r"events\.out\.tfevents\.(\d+)(\..*)")
"""An event file's name as tensorboard makes it: its timestamp (the wall clock's, in seconds), then the rest."""


class _QuietEventsThread:
    """Until closed, leave out the traceback Python prints for an OSError in TensorBoard's writer thread:
    the thread keeps it, and the next write or the close raises it, where :class:`EventsWriter` reports
    it (the process's hook is put back on close, where it is still this one)."""

    def __init__(self) -> None:
        from tensorboard.summary.writer import event_file_writer

        self._inner = inner = threading.excepthook
        writer_thread = event_file_writer._AsyncWriterThread

        def hook(args: Any) -> None:
            if not (isinstance(args.thread, writer_thread) and isinstance(args.exc_value, OSError)):
                inner(args)

        self._hook = hook
        threading.excepthook = hook

    def close(self) -> None:
        if threading.excepthook is self._hook:
            threading.excepthook = self._inner


_PERF_TAGS = ("rollout_seconds", "update_seconds", "other_seconds", "sps_update", "transitions_per_s")
"""Row keys TensorBoard gets as perf/<key> (CleanRL has no tags for them)."""


def _fault_values(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's fault counts, by their TensorBoard tags (``faults/<key>``)."""
    keys = ("env_steps_lost", "env_errors", "envs_unavailable", "episodes_cut")
    faults = {f"faults/{key}": row.get(key, 0) for key in keys}  # (0 in rows of versions before a key)
    faults.update((key, value) for key, value in row.items() if key.startswith("faults/"))
    return faults


def fault_tags_started(rows: Iterable[dict[str, Any]]) -> set[str]:
    """The faults/ tags :func:`write_tensorboard` started over ``rows`` (a resumed run's metrics, as
    kept): the resumed session goes on writing them, zeros included."""
    started: set[str] = set()
    for row in rows:
        started.update(tag for tag, value in _fault_values(row).items() if value and not math.isnan(value))
    return started


def tagged_values(row: dict[str, Any]) -> dict[str, float]:
    """An update's row by TensorBoard tag: CleanRL's tags for what CleanRL logs, perf/, faults/ (every
    count, zeros included), fleet/ and replicas/ (without the NaNs of figures no server, or that server, had)
    for the rest. --track logs them to W&B by the same names."""
    values = {
        "charts/learning_rate": row["learning_rate"],
        "charts/clip_coef": row["clip_coef"],
        "charts/SPS": row["sps"],
        "charts/num_envs": row["num_envs"],
    }
    for key in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac"):
        values[f"losses/{key}"] = row[key]
    values["losses/explained_variance"] = row["explained_variance"]
    for key in _PERF_TAGS:
        values[f"perf/{key}"] = row[key]
    values.update(_fault_values(row))
    if "eval/return_mean" in row:  # (--eval-every, at the updates it ran at: SB3's EvalCallback's tags)
        values["eval/mean_reward"] = row["eval/return_mean"]
        values["eval/mean_ep_length"] = row["eval/length_mean"]
    values.update(
        (key, value) for key, value in row.items() if key.startswith(("fleet/", REPLICAS)) and not math.isnan(value)
    )
    return values


def hyperparameters_text(config: dict[str, Any]) -> str:
    """CleanRL's "hyperparameters" text for TensorBoard (its TEXT tab; comparing runs by their settings): a
    Markdown table of the run's options, then of the PPO settings they came to (``ppo.``: the preset's
    included), the env and the policy, from what config.json holds."""
    rows = list(config["args"].items())  # (a token given is not among them: Args.to_json)
    rows += [(f"ppo.{key}", value) for key, value in config["ppo"].items()]
    rows += [("env_id", config["envs"]["env_id"]), ("num_envs", config["envs"]["num_envs"])]
    rows += [("policy", config["policy"]), ("device", config["device"])]
    cells = "\n".join(f"|{key}|{str(value).replace('|', chr(92) + '|')}|" for key, value in rows)
    return "|param|value|\n|-|-|\n" + cells


def write_tensorboard(writer: EventsWriter, row: dict[str, Any], faults_seen: set[str]) -> None:
    """An update's row as TensorBoard scalars (:func:`tagged_values`; episodes are logged as they end, as
    CleanRL does).

    A faults/ tag starts at its first update with a fault of its kind (``faults_seen``, the tags started
    so far this session, grows with it) and goes on at every update after: a run with no faults shows
    no flat zeros (metrics.jsonl keeps every count, zeros included)."""
    step = row["global_step"]
    for tag, value in tagged_values(row).items():
        if tag.startswith("faults/"):
            if tag not in faults_seen and not (value and not math.isnan(value)):
                continue
            faults_seen.add(tag)
        writer.add_scalar(tag, value, step)


OUTAGE_REDRAW_S = 1.0
"""How often, at most, the training bar is redrawn while every server is down (see :meth:`Recorder.fleet_down`)."""


class Recorder:
    """Where a training session reports its updates and episodes as they come: metrics.jsonl
    (``metrics_file``), TensorBoard (``writer``), W&B (``tracker``), --metrics-port (``live``), the
    progress bar (``bar``) or, with ``progress_lines``, a line every ``line_every`` seconds (and after the
    first update). ``last_row`` is the last update's metrics row (summary.json's), ``{}`` before any.

    ``start_time`` is the run's start on ``time.perf_counter()``'s clock (earlier sessions' seconds
    included); ``session_start`` and ``session_start_step`` this session's (for its SPS).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        counters: Counters,
        total_timesteps: int,
        metrics_file: IO[str],
        writer: EventsWriter | None,
        faults_seen: set[str],
        tracker: WandbRun | None,
        live: LearnerMetrics | None,
        bar: Any,
        progress_lines: bool,
        line_every: float,
        start_time: float,
        session_start: float,
        session_start_step: int,
    ) -> None:
        self.run_dir, self.counters, self.total_timesteps = run_dir, counters, total_timesteps
        self.metrics_file, self.writer, self.faults_seen = metrics_file, writer, faults_seen
        self.tracker, self.live, self.bar = tracker, live, bar
        self.progress_lines, self.line_every = progress_lines, line_every
        self.start_time, self.session_start, self.session_start_step = start_time, session_start, session_start_step
        self.last_row: dict[str, Any] = {}
        self.last_record = (session_start, session_start_step)  # (time, env steps) as of the last update recorded
        self.last_line: float | None = None  # (when the last line was printed; None: none yet)
        # (whether an update's line was printed: the first update's is at once, even a period after fleet_down's
        # waiting line, printed before any update: else a short run's log showed no update's figures at all)
        self.update_said = False
        self.postfix = ""  # (the bar's figures after its count, as of the last update)
        # While every server of the fleet is down (see fleet_down): since when (time.perf_counter()), the servers
        # down and those not joined; and when the bar was last redrawn to say so. None: the fleet is not all down.
        self.outage: tuple[float, int, int] | None = None
        self.outage_step = 0  # (the env step at which it began: counters.global_step then)
        self.outage_envs: int | None = None  # (the fleet's envs, all unavailable during it; None: not known)
        self.outage_drawn = -math.inf

    def episode(self, global_step: int, ep_return: Any, ep_length: Any) -> None:
        """An episode that ended at ``global_step``: TensorBoard's charts/episodic_*, W&B."""
        if self.writer is not None:
            self.writer.add_scalar("charts/episodic_return", ep_return, global_step)
            self.writer.add_scalar("charts/episodic_length", ep_length, global_step)
        if self.tracker is not None:
            self.tracker.episode(global_step, float(ep_return), int(ep_length))

    def record(
        self,
        result: UpdateResult,
        rollout_info: dict[str, Any],
        as_of: tuple[float, int] | None = None,
        evaluation: dict[str, Any] | None = None,
    ) -> None:
        """Count an update done and log it: metrics.jsonl, TensorBoard, W&B, --metrics-port, the progress bar.

        ``as_of`` (time, env steps): where this update's period ends, for the row's seconds, sps, sps_update
        and transitions_per_s; now by default. --overlap-update gives its rollout's end: the update is
        recorded during the next rollout, or after the last, when the time and steps since the last row
        are another rollout's, or none (the row's global_step and returns are as of its rollout's end).
        ``evaluation``: the eval/ columns of an evaluation run at this update (--eval-every), added to its row."""
        counters, bar, live = self.counters, self.bar, self.live
        counters.update += 1
        # (An outage is not over here: fleet_up ends it, at the first step a server answers, before any update
        # of a rollout after it. --overlap-update records the update of the last rollout before it as the run
        # ends, stopped or given up in it: ending it here, the bar's last state said nothing of it.)
        now = time.perf_counter()
        counters.seconds = now - self.start_time
        # sps: CleanRL's SPS, over this session; sps_update: over this update (since the last one's
        # end), whose wall time other_seconds completes (checkpoints, fleet lookups, dropped rollouts;
        # --overlap-update: the update runs during the next rollout, so the parts overlap and
        # other_seconds is what is left, at least 0).
        until, steps = as_of if as_of is not None else (now, counters.global_step)
        since = max(until - self.last_record[0], 1e-9)
        timing = {
            "seconds": until - self.start_time,
            "sps": (steps - self.session_start_step) / max(until - self.session_start, 1e-9),
            "sps_update": (steps - self.last_record[1]) / since,
            # (the transitions learned from, batch_size: sps_update counts every env step, those of
            # unavailable envs and the reset-only steps after an episode's end too)
            "transitions_per_s": result.batch_size / since,
            "other_seconds": max(0.0, since - rollout_info["rollout_seconds"] - result.seconds),
        }
        self.last_record = (until, steps)
        full = {**metrics_row(counters.update, timing, result, rollout_info), **(evaluation or {})}
        # (--metrics-port has every server's figures, as labels; the files those --replica-metrics says)
        row = written_row(full, rollout_info.get("replicas_written"))
        with writing(self.run_dir / rundir.METRICS):
            rundir.still_there(self.run_dir, self.metrics_file)
            rundir.append_jsonl(self.metrics_file, row)
        self.last_row = row
        if self.writer is not None:
            write_tensorboard(self.writer, row, self.faults_seen)
        if self.tracker is not None:
            self.tracker.update(row)
        if live is not None:
            live.observe_update(
                full,
                solved=counters.solved_at_step is not None,
                server_ids=rollout_info.get("server_ids"),
                not_joined=rollout_info.get("not_joined", ()),
            )
            if self.outage is not None:  # (--overlap-update's last: its row is from before the outage)
                live.observe_fleet_down(self.outage[1], self.outage_envs)
        if bar is not None:
            bar.total = max(bar.total, counters.global_step)  # the last rollout may run past it
            widget_total(bar)
            # (not redrawn here: the update below redraws it, with its new figures, as often as tqdm's
            # mininterval lets it, which a redraw at every update, thousands in a log, bypassed). While servers
            # are down or have not joined, it says which share of the fleet is missing, as the progress lines do.
            # (the last evaluation's mean return, --eval-every, at every update from the first on)
            self.postfix = self._bar_figures(timing["sps"], row)
            bar.set_postfix_str(self.postfix, refresh=False)
            bar.update(counters.global_step - bar.n)
        elif self.progress_lines and (
            not self.update_said or self.last_line is None or now - self.last_line >= self.line_every
        ):
            self.last_line, self.update_said = now, True
            self._say(progress_line(row, self.total_timesteps, counters.eval_return_mean))

    def add_evaluation(self, evaluation: dict[str, Any]) -> None:
        """The eval/ columns (``evaluation``) of an evaluation of the last update's nets run once its row was
        written: a run solved (--stop-at-return) in the rollout after it, which is not learned from, ends with those
        nets, evaluated as it stops (PeriodicEval.final); a resumed session's first, its checkpoint's evaluation
        cut short by a stop or a kill (PeriodicEval.redo: the row is the checkpoint's update's, metrics.jsonl's last,
        which train() makes this Recorder's ``last_row``). Added to that row as :meth:`record` would have
        added them: metrics.jsonl's last row is written again with them (in place: the file stays one row an
        update, whenever the learner is killed), TensorBoard and W&B get them at its step, --metrics-port its
        gauge, and the bar its return."""
        row = {**self.last_row, **evaluation}
        path = self.run_dir / rundir.METRICS
        with writing(path):
            rundir.still_there(self.run_dir, self.metrics_file)
            # (in place, one write: cut off and appended again, a kill or a failed append between the two left
            # the file without the row of an update the last checkpoint counts)
            rundir.rewrite_last_row(path, row)
        self.last_row = row
        if self.writer is not None:
            for tag, value in tagged_values(row).items():
                if tag.startswith("eval/"):
                    self.writer.add_scalar(tag, value, row["global_step"])
        if self.tracker is not None:  # (the row again at its step: W&B keeps a step's last values)
            self.tracker.update(row)
        if self.live is not None:
            self.live.observe_evaluation(evaluation)
        if self.bar is not None:
            self.postfix = self._bar_figures(row["sps"], row)
            self.bar.set_postfix_str(self.postfix)

    def _bar_figures(self, sps: float, row: dict[str, Any]) -> str:
        """The bar's figures after its count as of the update of ``row`` (:meth:`record`'s, and
        :meth:`add_evaluation`'s once a solved run's last nets are evaluated): what the fleet misses
        (:func:`~learner.progress.fleet_note`), first, as every note of the bar is (see
        :func:`~learner.progress.bar_postfix`), then ``sps``, the recent return, the last evaluation's mean return."""
        return bar_postfix(sps, row["episodic_return_mean"], fleet_note(row)) + eval_note(
            self.counters.eval_return_mean
        )

    def fleet_down(self, servers: int, not_joined: int, envs: int | None = None) -> None:
        """Every server of the fleet is down (``servers``; ``not_joined``: listed ones not joined; ``envs``: the
        fleet's envs, every one unavailable, for --metrics-port's gauges): the loop calls
        this each time it finds so, once per step that waits for one to come back (at most a second: see
        RemoteVectorEnv's "Every server down"), until a step finds one up (:meth:`fleet_up`). No step counts and no
        update is recorded meanwhile, so the bar would stay frozen on the last update's figures: it says instead
        how long the fleet has been down (:func:`~learner.progress.fleet_down_note`), redrawn at most every
        :data:`OUTAGE_REDRAW_S` (or tqdm's mininterval, if longer), so that its elapsed time runs on; without a
        bar, a line says it at the lines' own period (``line_every`` after the last one). The waiting step
        itself redraws: no thread of its own.

        The bar says it first, before the last update's (stale) SPS and return, as :meth:`evaluating` says an
        evaluation (``0% 12.0k/100M steps, all 2 servers down for 20 s, waiting, SPS 2,302, return 180.8``):
        after them, tqdm cut the line at the terminal's width, and on an 80-column terminal (the narrow bar:
        :func:`~learner.progress._narrow_as_well`) the bar read ``0% 19.2k/100M steps, SPS 3,266, return 199.4,
        all 2 servers down for 10 s, wa``, at 60 columns ``0% 15.9k/100M steps, SPS 2,712, return 140.0, all 2
        serve`` for the whole of a 23-s outage: its time, the one part redrawn, cut off (with a longer step count,
        SPS or return, on 80 columns too), a bar frozen where the note was to show the run waiting."""
        now = time.perf_counter()
        self.outage_envs = envs
        if self.outage is None:
            self.outage, self.outage_step = (now, servers, not_joined), self.counters.global_step
            if self.live is not None:  # (--metrics-port: its gauges say it too, until fleet_up)
                self.live.observe_fleet_down(servers, envs)
            self._tensorboard_fleet(0, servers)
        else:
            self.outage = (self.outage[0], servers, not_joined)
        self._say_waiting(fleet_down_note(servers, now - self.outage[0], not_joined), now)

    def _say_waiting(self, note: str, now: float) -> None:
        """While no update comes (:meth:`fleet_down`, :meth:`evaluating`): the bar says ``note`` before the last
        update's SPS and return (so that a narrow terminal, which cuts the line at its width, cuts those, not the
        note), redrawn at most every :data:`OUTAGE_REDRAW_S` (or tqdm's mininterval, if longer); without a bar, a
        line (:func:`~learner.progress.waiting_line`) says it at the lines' own period, after the figures (lines
        are not cut)."""
        bar, row = self.bar, self.last_row
        if bar is not None:
            if now - self.outage_drawn >= max(OUTAGE_REDRAW_S, getattr(bar, "mininterval", 0.0)):
                self.outage_drawn = now
                sps, recent = row.get("sps"), row.get("episodic_return_mean")
                postfix = bar_postfix(sps, recent, note) + eval_note(self.counters.eval_return_mean)
                bar.set_postfix_str(postfix)  # (redrawn)
        elif self.progress_lines and (self.last_line is None or now - self.last_line >= self.line_every):
            self.last_line = now
            line = waiting_line(
                row,
                self.total_timesteps,
                step=self.session_start_step,
                seconds=now - self.start_time,
                note=note,
                evaluation=self.counters.eval_return_mean,
            )
            self._say(line)

    def evaluating(self, step: int, ended: int, episodes: int) -> None:
        """An evaluation (--eval-every) of the update at env step ``step`` is under way, ``ended`` of its
        ``episodes`` played: PeriodicEval.run calls this as it starts and after each of its steps, until
        :meth:`evaluated`. No update comes while it runs, so the bar would stay frozen on the last update's
        figures (with --eval-episodes 1000, for minutes): it says the evaluation instead
        (:func:`~learner.progress.eval_running_note`), at once as it starts, then redrawn at most every
        :data:`OUTAGE_REDRAW_S`, as :meth:`fleet_down` redraws it; without a bar, a line says it at the lines' own
        period. The evaluation's step itself redraws: no thread of its own.

        The bar says it first, before the last update's SPS and return (``3%| | 3.07k/100k steps [00:02<01:29,
        evaluating at step 3,072: 28 of 60 episodes, SPS 4,768, return 35.25]``, as the fleet's outage is said):
        after them, tqdm cut the line at the terminal's width, and on an 80-column terminal the bar read
        ``evaluating at step 3,072: 28 of`` (at step 1,024,000 with SPS 12,345, ``evaluating at step 1,024,000:``,
        the count itself cut off): frozen, as before, where its count was to show the evaluation going on."""
        self._say_waiting(eval_running_note(step, ended, episodes), time.perf_counter())

    def recording_video(self, step: int, steps: int) -> None:
        """--capture-video is recording its video of the nets of the update at env step ``step``, ``steps`` of its
        episode played: VideoCapture.record calls this as it starts and after each step, until :meth:`evaluated`.
        Said as :meth:`evaluating` says an evaluation (:func:`~learner.progress.video_running_note`, first, redrawn
        at most every :data:`OUTAGE_REDRAW_S`; a line at the lines' period): no update comes while it plays, and
        the bar showed the last update's figures (or the evaluation's last count), frozen, for seconds (a MuJoCo
        episode) or minutes (a long one)."""
        self._say_waiting(video_running_note(step, steps), time.perf_counter())

    def evaluated(self) -> None:
        """The evaluation :meth:`evaluating` said (or the video :meth:`recording_video` said) is over (ended,
        stopped or failed): the bar shows the last update's figures again at once, until the next update's (the
        evaluated one's, recorded next)."""
        self.outage_drawn = -math.inf
        if self.bar is not None and self.outage is None:
            self.bar.set_postfix_str(self.postfix)

    def fleet_up(self, up: Collection[str], down: int, envs_unavailable: int | None = None) -> None:
        """A step found a server up again after :meth:`fleet_down`: the bar shows the last update's figures
        again at once (not "waiting" until the next update); the lines go on at their period. ``up``: the servers
        up now, as metrics name them (:meth:`~learner.fleetwatch.FleetWatch.label`), and ``down`` how many of the
        fleet's are not: --metrics-port's gauges say so at once, not "every server down" until the next update,
        which a rollout of slow envs (Atari's, a simulator's) puts minutes away (``envs_unavailable``: those of
        the servers still down)."""
        if self.outage is not None:
            back = f"{len(up)} of {len(up) + down} back" if down else "all back"
            self._tensorboard_fleet(len(up), down, said=f"{self._outage_said()}; then {back}")
        self.outage, self.outage_drawn = None, -math.inf
        if self.live is not None:
            self.live.observe_fleet_up(up, down, envs_unavailable)
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix)

    def run_ended(self, stop_reason: str | None, *, propagating: bool) -> None:
        """The run ends (``stop_reason``, summary.json's): where it ends while every server is down (stopped, or
        given up: --give-up-after), TensorBoard's ``fleet`` text says that outage, as :meth:`fleet_up` says one that
        ended (see :meth:`_tensorboard_fleet`). A failed write raises, as the error of a run that ends well; where
        another error ends the run (``propagating``), it is logged (that error follows)."""
        if self.outage is None or self.writer is None:
            return
        try:
            self.writer.add_text(
                "fleet", f"{self._outage_said()}; the run ended then ({stop_reason})", self.outage_step
            )
        except OSError as err:
            if not propagating:
                raise
            log.error("%s", err)

    def _outage_said(self) -> str:
        """The outage under way, for TensorBoard's ``fleet`` text: ``all 2 servers down for 35 s at step 12,288``."""
        since, servers, not_joined = cast(tuple[float, int, int], self.outage)
        note = fleet_down_note(servers, time.perf_counter() - since, not_joined, waiting=False)
        return f"{note} at step {self.outage_step:,}"

    def _tensorboard_fleet(self, up: int, down: int, said: str | None = None) -> None:
        """TensorBoard while every server is down: no update comes, so it got nothing, a run that just stopped in
        its charts while the bar said ``all 2 servers down for 35 s, waiting`` (for as long as --give-up-after
        lets it). As the fleet goes down (:meth:`fleet_down`) and as a server is back (:meth:`fleet_up`), an
        update's ``fleet/servers`` (servers up: ``up``) and ``faults/servers_down`` (``down``), at the env step the
        run is at (where episodes are written too), so that their charts fall to 0 and rise again where it
        happened; as it ends, ``said``: a ``fleet`` text, at the step it began, saying how long it lasted (a step
        axis shows little of that time: a step a second at most, each waiting for a server), as :meth:`run_ended`
        does for a run that ended in it. (W&B and metrics.jsonl are left to the updates: one row an update.)"""
        if self.writer is None:
            return
        step = self.counters.global_step
        self.writer.add_scalar("fleet/servers", up, step)
        self.writer.add_scalar("faults/servers_down", down, step)
        self.faults_seen.add("faults/servers_down")  # (started: the updates go on writing it, zeros included)
        if said is not None:
            self.writer.add_text("fleet", said, self.outage_step)

    def fleet_said(self) -> str:
        """What the bar's last state (:func:`~learner.progress.close_bar`) says of the fleet: the last update's
        :func:`~learner.progress.fleet_note`, or, for a run that ended while every server was down (stopped, or
        given up: --give-up-after), that outage, no longer "waiting"."""
        if self.outage is None:
            return fleet_note(self.last_row)
        since, servers, not_joined = self.outage
        return fleet_down_note(servers, time.perf_counter() - since, not_joined, waiting=False)

    def _say(self, line: str) -> None:
        """Print a progress line (the bar's stand-in: stdout), or, where stdout's reader has gone, stop printing."""
        try:
            print(line, flush=True)  # noqa: T201
        except BrokenPipeError:
            self._stdout_gone()

    def _stdout_gone(self) -> None:
        """stdout's reader has exited (``learner train | head``, a ``tee`` killed): the run goes on, its
        lines (and the closing ones) to /dev/null, rather than ending with a BrokenPipeError mid-run."""
        self.progress_lines = False
        to_devnull(sys.stdout.fileno())
        log.warning("stdout was closed (its reader exited): no more progress lines; the run goes on (%s)", self.run_dir)


def build_summary(
    counters: Counters,
    *,
    stop_reason: str | None,
    threshold: float | None,
    last_row: dict[str, Any],
    device: torch.device,
    faults: dict[str, int] | None,
    replicas: dict[str, ReplicaTotals],
) -> dict[str, Any]:
    """summary.json: the run as ``counters`` hold it; ``faults``: the whole run's fault counts (None: no
    fleet); ``replicas``: this session's statistics per env server."""
    summary: dict[str, Any] = {
        "total_steps": counters.global_step,
        "seconds": round(counters.seconds, 3),
        "final_return_mean": mean_or_none(counters.recent_returns),
        "solved": counters.solved_at_step is not None,
        "solved_at_step": counters.solved_at_step,
        "solved_at_seconds": None if counters.solved_at_seconds is None else round(counters.solved_at_seconds, 3),
        "solved_threshold": threshold,
        "stop_reason": stop_reason,
        "episodes": counters.episodes,
        "updates": counters.update,
        "sps": last_row.get("sps"),
        "device": str(device),
        "cuda_max_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if device.type == "cuda"
        else None,
        "env_steps_lost": counters.env_steps_lost,
        "env_errors": counters.env_errors,
        "episodes_cut": counters.episodes_cut,
        "best_return": counters.best_return,
        "best_step": counters.best_step,
        # --eval-every: the last evaluation's mean return, and the best one's (None: none ran)
        "eval_return_mean": counters.eval_return_mean,
        "best_eval_return": counters.best_eval_return,
        "best_eval_step": counters.best_eval_step,
    }
    if faults is not None:
        summary.update(faults)
    if replicas:
        summary["replicas"] = {address: totals.as_dict() for address, totals in replicas.items()}
    return summary


def mean_or_none(values: list[float] | list[int]) -> float | None:
    """The mean of ``values`` (the recent episodes' returns or lengths), None when there are none."""
    return mean_of(values) if values else None  # (finite where the returns' sum overflowed float64)


@contextlib.contextmanager
def plot_at_exit(enabled: bool) -> Iterator[list[Path]]:
    """Writes returns.png into the run dir the block appends to the list yielded, once the block is over
    (its envs closed): whether the run ended or failed (then a failed plot is logged, not raised over
    the run's error), but not when it was aborted (a second Ctrl-C)."""
    run_dirs: list[Path] = []
    try:
        yield run_dirs
    except KeyboardInterrupt:
        raise
    except BaseException:
        if enabled and run_dirs:
            try:
                _plot(run_dirs[0])
            except Exception:
                log.exception("could not plot %s", run_dirs[0])
        raise
    if enabled and run_dirs:
        _plot(run_dirs[0])


def _plot(run_dir: Path) -> None:
    from learner.plot import plot_runs

    try:
        plot_runs([run_dir], run_dir / rundir.PLOT, output_name=None)
    except (OSError, ValueError) as err:  # no episode ended yet, a full disk, a run dir gone or moved
        log.warning("no plot written: %s", err)
