"""``learner train --track``: a run logged to Weights & Biases, as CleanRL's ``--track`` does.

Imported only with --track (wandb is the optional extra ``track``), so a run without it pays nothing.
CleanRL has W&B mirror its TensorBoard files (``sync_tensorboard``); this logs the same figures itself,
from where metrics.jsonl is written, so it works with --no-tensorboard too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import wandb
except ModuleNotFoundError as err:  # (learner.cli names the extra that brings it)
    if err.name != "wandb":
        raise
    raise ModuleNotFoundError(
        "--track needs wandb, which is not installed here: pip install 'envfleet[track]'", name="wandb"
    ) from err
if getattr(wandb, "__file__", None) is None:  # (a folder ./wandb, as CleanRL's runs leave, imported as a namespace)
    raise ModuleNotFoundError(
        f"--track needs wandb, which is not installed here (what imports as wandb is the folder "
        f"{next(iter(getattr(wandb, '__path__', [])), '?')}): pip install 'envfleet[track]'",
        name="wandb",
    )

from learner import rundir
from learner.config import Args
from learner.errors import TrackingError
from learner.records import tagged_values

__all__ = ["UNTAGGED", "WandbRun", "tracked"]

log = logging.getLogger(__name__)

UNTAGGED = {
    "update": "charts/update",
    "seconds": "perf/seconds",
    "episodes": "charts/episodes",
    "episodic_return_mean": "charts/episodic_return_mean",
    "episodic_length_mean": "charts/episodic_length_mean",
    "batch_size": "charts/batch_size",
}
"""The W&B names of metrics.jsonl's figures that have no TensorBoard tag (``records.tagged_values`` names
the others as TensorBoard does)."""


class WandbRun:
    """The W&B run of a run dir: started (or, resumed, gone on) at the start of a session, given every
    update's row and every episode as they come, finished with the summary at the end.

    W&B takes the steps of a run in increasing order only: episodes are held until the row of the
    update after them (with --overlap-update, the next rollout's end before its update's row), and
    points before the W&B run's last step (a resumed run redoes the steps after its checkpoint, which
    the session before logged already) are left out, where W&B would drop them with a warning each."""

    def __init__(self, run_dir: Path, config: dict[str, Any], args: Args) -> None:
        saved_path = run_dir / rundir.WANDB_RUN
        saved: dict[str, Any] = rundir.read_json(saved_path) if saved_path.is_file() else {}
        try:
            self._run = wandb.init(
                # (wandb's files in the run dir, with the rest of the run, unless WANDB_DIR says where:
                # ./wandb, wandb's default, lands among the run dirs when they are the working folder's)
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir.resolve()),
                project=args.wandb_project_name,
                entity=args.wandb_entity or saved.get("entity") or None,
                name=run_dir.name,
                id=saved.get("id"),
                resume="allow" if saved.get("id") else None,
            )
            # config.json's content, this session's (W&B keeps one config per run: the last one given)
            session = {key: value for key, value in config.items() if key != "earlier_sessions"}
            self._run.config.update({**session, "run_dir": str(run_dir.resolve())}, allow_val_change=True)
        except wandb.Error as err:
            wandb.finish(exit_code=1)  # (one started, if any)
            raise TrackingError(
                f"--track: W&B could not start the run: {err} (or log offline, WANDB_MODE=offline, and upload "
                "later with `wandb sync`)"
            ) from err
        self.id = self._run.id
        self._first_step = self._run.starting_step if saved.get("id") else 0
        self._skipped = 0
        self._episodes: dict[int, list[tuple[float, int]]] = {}  # global step -> (return, length) of those ended
        self._videos: list[tuple[int, Path]] = []  # (--capture-video's held until the row of their update)
        self._row_step = -1  # (the last update row's step logged)
        self.summary: dict[str, Any] | None = None
        self.record: dict[str, Any] | None = None  # (wandb-run.json's; None: W&B disabled, WANDB_MODE=disabled)
        if self._run.disabled:
            log.info("W&B is disabled here (WANDB_MODE=disabled): --track logs nothing")
            return
        url = None if self._run.offline else self._run.url  # (asked offline, wandb warns there is none)
        # files: wandb's own folder for this session (offline, what `wandb sync` uploads)
        record = {
            "id": self._run.id,
            "project": self._run.project,
            "entity": self._run.entity or None,
            "url": url,
            "files": str(Path(self._run.dir).parent),
        }
        log.info("W&B run %s (%s)", self._run.id, url or "offline")
        try:
            with rundir.writing(saved_path):
                rundir.write_json(saved_path, record)
        except BaseException:
            self._run.finish(exit_code=1)
            raise
        self.record = record

    def episode(self, global_step: int, episodic_return: float, episodic_length: int) -> None:
        """An episode that ended at ``global_step`` (logged with the next update's row)."""
        self._episodes.setdefault(global_step, []).append((episodic_return, episodic_length))

    def update(self, row: dict[str, Any]) -> None:
        """An update's metrics.jsonl row, at its global step: the episodes up to it first."""
        step = row["global_step"]
        self._log_episodes(up_to=step)
        values: dict[str, Any] = {"global_step": step, **tagged_values(row)}
        values.update((name, row[key]) for key, name in UNTAGGED.items() if row.get(key) is not None)
        self._log(values, step)
        self._row_step = step
        held, self._videos = self._videos, []
        for video_step, path in held:
            self.video(video_step, path)

    def video(self, global_step: int, path: Path) -> None:
        """--capture-video's GIF of the nets at ``global_step`` (``videos/policy``, a wandb.Video of the file: no
        moviepy needed for a GIF already written), logged at that step once the update's row is (before it, the
        row's episodes before it would be at earlier steps, which W&B drops)."""
        if global_step > self._row_step:
            self._videos.append((global_step, path))
            return
        try:
            self._log({"videos/policy": wandb.Video(str(path), format="gif")}, global_step)
        except Exception as err:  # (W&B's: the GIF is in the run dir all the same)
            log.warning("W&B run %s: could not log the video %s: %s: %s", self.id, path, type(err).__name__, err)

    def finish(self, exit_code: int) -> None:
        """Put :attr:`summary` (summary.json's) into the W&B run's summary and finish it with ``exit_code``
        (the command's: 0, 130 for Ctrl-C, 1 for an error). The episodes held are logged only for a run
        that ended as asked: those after a stopped run's last update are not in its checkpoint, and its
        resumed run plays those steps again (as TensorBoard, which hides them then). A failure here is
        logged, not raised: it must not hide what ended the run."""
        try:
            if exit_code == 0:
                self._log_episodes(up_to=None)
            if self._skipped:
                log.info(
                    "W&B run %s: %d points before step %d (the steps this session redid from its checkpoint) "
                    "were left out: the W&B run has those the session before logged",
                    self.id,
                    self._skipped,
                    self._first_step,
                )
            if self.summary is not None:
                self._run.summary.update(self.summary)
            self._run.finish(exit_code=exit_code)
        except Exception as err:
            log.warning("W&B run %s: could not finish it: %s: %s", self.id, type(err).__name__, err)

    def _log_episodes(self, up_to: int | None) -> None:
        # One point per step: episodes that ended at the same step are averaged (W&B keeps one value
        # per step and name).
        for step in sorted(s for s in self._episodes if up_to is None or s <= up_to):
            ended = self._episodes.pop(step)
            mean_return = sum(r for r, _ in ended) / len(ended)
            mean_length = sum(n for _, n in ended) / len(ended)
            values = {"global_step": step, "charts/episodic_return": mean_return}
            self._log({**values, "charts/episodic_length": mean_length}, step)

    def _log(self, values: dict[str, Any], step: int) -> None:
        if step < self._first_step:
            self._skipped += 1
            return
        self._run.log(values, step=step)


@contextlib.contextmanager
def tracked(run_dir: Path, config: dict[str, Any], args: Args) -> Iterator[WandbRun]:
    """A :class:`WandbRun` for the session, finished on the way out: exit code 0 for a run that ended as
    asked, 130 for Ctrl-C (summary.json's stop_reason "interrupted", or a second Ctrl-C), 1 for an
    error (which goes on its way)."""
    run = WandbRun(run_dir, config, args)
    exit_code = 1
    try:
        yield run
        interrupted = run.summary is not None and run.summary.get("stop_reason") == "interrupted"
        exit_code = 130 if interrupted else 0
    except KeyboardInterrupt:
        exit_code = 130
        raise
    finally:
        run.finish(exit_code)
