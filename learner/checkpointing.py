"""A training run's checkpoints: what they hold, when they are written, and the best one (--save-best)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import gymnasium as gym
import torch

from env_server.ratelimit import LogBudget
from learner import rundir
from learner.checkpoint import capture_rng, save_best_checkpoint, save_checkpoint
from learner.config import Args, PPOConfig
from learner.errors import RunDirWriteError
from learner.normalize import DictRunningMeanStd, RewardScaler, RunningMeanStd
from learner.ppo import Agent
from learner.resume import RECENT, Counters
from learner.rundir import writing
from learner.stats import format_return, mean_of

__all__ = ["Checkpointer", "stopped_in_update"]

BEST_LOG_S = 60.0
"""How often, at most, a new best.pt is said at INFO (the first at once; the others at DEBUG, and the next
INFO line counts them). Early in a run nearly every update beats the last best: one line each was two
thirds of a 20k-step run's INFO log, in which the checkpoints and the fleet's changes were what to read.
Not DEBUG alone: a long run's INFO log says, now and then, where its best policy so far is, and how good."""

_SOLVED = ("solved_at_step", "solved_at_seconds", "solved_threshold")
"""The counters of a solve, which a run stopped after one in the rollout it drops keeps."""
_SOLVE_COUNTERS = (*_SOLVED, "best_return", "best_step")
"""What a checkpoint taken at the last update carries over from a run solved after it."""


def _sync(metrics: IO[str]) -> None:
    """``metrics``' rows to disk (fsync); a file system that cannot (EINVAL) keeps them as it does."""
    try:
        os.fsync(metrics.fileno())
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise


def stopped_in_update(saved_step: int | None) -> str:
    """What a run stopped during an update says: no checkpoint of that update is written (the nets are
    half-way through it); ``saved_step`` is the step of the last checkpoint on disk, None if there is none."""
    if saved_step is None:
        return (
            "stopped during an update: no checkpoint written, and none was before (see --checkpoint-every): "
            "resuming starts this run over"
        )
    return (
        f"stopped during an update: no checkpoint of it written; resuming starts at the last one, step {saved_step:,}"
    )


class Checkpointer:
    """The checkpoints of one training session: the learner's state as of the last update's end
    (``last_update``), the last checkpoint written (``saved_step``, ``saved_update``, ``saved_at``), the
    cadence (--checkpoint-every, --checkpoint-seconds) and the best mean return (``best.pt``, --save-best).

    ``updating`` is set by the loop from the batch's making until the update is :meth:`finished`: a
    checkpoint then would mix two updates. ``write`` writes a step's checkpoint (``save_checkpoint``'s
    signature); ``logger`` is the training loop's, which says where each checkpoint went.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        args: Args,
        hp: PPOConfig,
        obs_space: gym.Space[Any],
        action_space: gym.Space[Any],
        served: dict[str, Any],
        agent: Agent,
        optimizer: torch.optim.Optimizer,
        counters: Counters,
        recent_returns: deque[float],
        recent_lengths: deque[int],
        obs_rms: RunningMeanStd | DictRunningMeanStd | None,
        reward_scaler: RewardScaler | None,
        update_rng: torch.Generator | None,
        resumed: bool,
        write: Callable[..., Path] = save_checkpoint,
        logger: logging.Logger,
        metrics: IO[str] | None = None,
        versions: dict[str, str] | None = None,
    ) -> None:
        self.run_dir, self.args, self.hp = run_dir, args, hp
        # (config.json's: what wrote each checkpoint, for a later version's errors; plain strings, as weights_only
        # loads them: torch's __version__ is a TorchVersion, a str subclass torch's safe unpickler refuses)
        self.versions = None if versions is None else {str(k): str(v) for k, v in versions.items()}
        self.obs_space, self.action_space, self.served = obs_space, action_space, served
        self.agent, self.optimizer, self.counters = agent, optimizer, counters
        self.recent_returns, self.recent_lengths = recent_returns, recent_lengths
        self.obs_rms, self.reward_scaler, self.update_rng = obs_rms, reward_scaler, update_rng
        self.write, self.log, self.metrics = write, logger, metrics
        self.saved_step = counters.global_step if resumed else None  # of the last checkpoint written
        self.saved_counters: dict[str, Any] | None = None  # (its counters; this session's checkpoints only)
        self.saved_update, self.saved_at = counters.update, time.monotonic()  # (a resumed run's: its checkpoint's)
        self.last_update: dict[str, Any] = {}  # as of the last update's end (set once the envs are reset)
        self.updating = False  # the nets are being updated: a checkpoint now would mix two updates
        self.best_said = LogBudget(BEST_LOG_S)  # (a new best.pt said at INFO; those left out, at DEBUG)

    def rollout_state(self) -> dict[str, Any]:
        """What collecting a rollout changes in the learner, as of now: the counters (recent episodes
        included), every RNG state and the observation statistics. Taken at each update's end (a few
        small copies), so that a run stopped mid-rollout is saved as of its last update: the partial
        rollout is not learned from, and a resumed run starts that rollout over. The reward scaler
        is as of the last batch made (--overlap-update: the next rollout's batch is made before the
        update in flight is done)."""
        counters, obs_rms, reward_scaler, update_rng = self.counters, self.obs_rms, self.reward_scaler, self.update_rng
        counters.recent_returns, counters.recent_lengths = list(self.recent_returns), list(self.recent_lengths)
        return {
            "counters": dataclasses.asdict(counters),
            "rng": capture_rng(),
            "obs_rms": {k: v.clone() for k, v in obs_rms.state_dict().items()} if obs_rms is not None else None,
            "reward_scaler": {"rms": {k: v.clone() for k, v in reward_scaler.rms.state_dict().items()}}
            if reward_scaler is not None
            else None,
            "update_rng": update_rng.get_state() if update_rng is not None else None,
        }

    def payload(self, state: dict[str, Any]) -> dict[str, Any]:
        return {
            "args": self.args.to_json(),
            "ppo": dataclasses.asdict(self.hp),
            "observation_space": str(self.obs_space),
            "action_space": str(self.action_space),
            "served": self.served,
            # What wrote it (envfleet's version and commit, Python's, torch's, ...): a later version that cannot
            # load its nets names it (checkpoint.written_by; before 2026-12-07 only config.json said, the run's
            # latest session's, and nothing said where a checkpoint was copied out of its run dir).
            **({"versions": self.versions} if self.versions is not None else {}),
            "model": self.agent.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **state,
            # (``due`` only where something is: an envfleet from before it, which leaves out the counters it does
            # not know with a warning to upgrade, read every checkpoint of this one so, where none is lost)
            "counters": {k: v for k, v in state["counters"].items() if k != "due" or v},
        }

    def save(self, reason: str, state: dict[str, Any]) -> Path:
        """A checkpoint of the nets and the optimizer with ``state`` (``rollout_state()``'s, from the same
        update's end or later; --overlap-update: from the end of the rollout the update learned from)."""
        step = int(state["counters"]["global_step"])
        if self.metrics is not None:  # (its rows to disk first: after a power cut, none the checkpoint counts is lost)
            with writing(self.run_dir / rundir.METRICS):
                _sync(self.metrics)
        with writing(rundir.checkpoint_path(self.run_dir, step), torch_save=True):
            path = self.write(self.run_dir, step, self.payload(state), keep=self.args.keep_checkpoints)
        self.saved_step, self.saved_update, self.saved_at = step, int(state["counters"]["update"]), time.monotonic()
        self.saved_counters = dict(state["counters"])
        self.log.info("checkpoint (%s): %s", reason, path)
        return path

    def judge_best(self, state: dict[str, Any]) -> None:
        """After an update: a new best mean return of the last 20 episodes (as of the rollout it learned
        from) makes its nets checkpoints/best.pt (--save-best). A mean that is no number (NaN, or infinite:
        returns that overflowed float64) is none to judge; a best that is none (a run's before this was
        looked at) is beaten by any."""
        counters = self.counters
        recent = state["counters"]["recent_returns"]
        if len(recent) == RECENT:
            mean = mean_of(recent)
            best = counters.best_return
            if math.isfinite(mean) and (best is None or not math.isfinite(best) or mean > best):
                counters.best_return, counters.best_step = mean, int(state["counters"]["global_step"])
                if self.args.save_best:
                    state["counters"].update(best_return=counters.best_return, best_step=counters.best_step)
                    with writing(self.run_dir / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT, torch_save=True):
                        path = save_best_checkpoint(self.run_dir, self.payload(state))
                    self._say_best(mean, counters.best_step, path)
        state["counters"].update(best_return=counters.best_return, best_step=counters.best_step)

    def _say_best(self, mean: float, step: int, path: Path) -> None:
        """Say that best.pt now holds the nets of ``step``, of mean return ``mean``: at INFO at most once per
        :data:`BEST_LOG_S` (with the new bests since), else at DEBUG."""
        since = self.best_said.due()
        if since is None:
            self.log.debug("best so far (mean return %s at step %d): %s", format_return(mean), step, path)
            return
        self.log.info(
            "best so far (mean return %s at step %d%s): %s",
            format_return(mean),
            step,
            f"; {since} other new best{'s' if since > 1 else ''} since the last such line, one a minute at most"
            if since
            else "",
            path,
        )

    def finished(self, state: dict[str, Any]) -> None:
        """The update just recorded is done, with ``state`` (``rollout_state()``'s) as of its rollout's
        end: the run may stop (or be checkpointed) as of it."""
        counters, args = self.counters, self.args
        if self.update_rng is not None:
            state["update_rng"] = self.update_rng.get_state()
        state["counters"]["update"] = counters.update
        self.last_update = state
        self.updating = False  # (done: a failure writing best.pt next is no failure in an update)
        self.judge_best(state)
        if args.checkpoint_every and (
            self.saved_step is None  # (a new run's first update: a run killed before any could only start over)
            or (
                counters.update - self.saved_update >= args.checkpoint_every
                and time.monotonic() - self.saved_at >= args.checkpoint_seconds
            )
        ):
            self.save(f"update {counters.update}", self.last_update)

    def _on_disk(self, state: dict[str, Any]) -> bool:
        """Whether the last checkpoint written holds ``state`` already: of its step, with the same counters (a
        solve or best return judged since would differ) but for the wall time, a few ms later at the run's end.
        (Nothing else changes without a step: the nets, the optimizer, the RNG states and the statistics.)

        A video it says is due (``due``) that is done since (the run's end's, filmed after it was written) is no
        difference: a --resume takes a video whose GIF is there as done (resume.owed_work), so a run filmed at its
        end writes its last checkpoint once, as before the checkpoints said what is due. An evaluation done since
        changes its counters (eval_return_mean, best_eval_*): that one is written again."""
        saved = self.saved_counters
        if saved is None or state["counters"]["global_step"] != self.saved_step:
            return False
        now, before = state["counters"].get("due") or [], saved.get("due") or []
        if set(now) <= set(before) and set(before) - set(now) <= {"video"}:
            now = before  # (only its video done since: its GIF says so)
        return {**state["counters"], "seconds": None, "due": now} == {**saved, "seconds": None, "due": before}

    def end(self, stop_reason: str | None) -> Counters:
        """The run's end (``stop_reason``: summary.json's, None while an error is on its way): its last
        checkpoint, when one is due, and the counters its summary reports."""
        counters = self.counters
        state: dict[str, Any] | None
        last_update, updating = self.last_update, self.updating
        if stop_reason in ("total_timesteps", "stop_at_return"):
            state = self.rollout_state()
            if not updating:  # (the episodes since the last update: mostly of its nets, the run's last)
                self.judge_best(state)
            if (
                stop_reason == "stop_at_return"
                and state["counters"]["global_step"] != last_update["counters"]["global_step"]
            ):
                # Solved mid-rollout: the partial rollout is not learned from, so the checkpoint is
                # as of the last update (its counters, RNG states and statistics, as after a Ctrl-C),
                # with the solve and the best return: a run resumed from it starts that rollout over.
                solved = {k: state["counters"][k] for k in _SOLVE_COUNTERS}
                state = {**last_update, "counters": {**last_update["counters"], **solved}}
            if self._on_disk(state):
                state = None  # (the last update's, checkpointed as it ended: the same step twice, as the same file)
        else:
            # Stopped mid-rollout (Ctrl-C, an error) or mid-update: the run is what it was at its last
            # update, for the checkpoint and the summary alike (none is written when that one is on
            # disk already, or when the nets are half-way through the next update).
            if updating and self.run_dir.is_dir():  # (one deleted mid-run: the error says so, no resuming)
                self.log.warning("%s", stopped_in_update(self.saved_step))
            # Solved in the partial rollout (as the log said): the summary and the checkpoint keep the solve,
            # as a run stopped at its --stop-at-return does.
            solved_since: dict[str, Any] = {}
            if counters.solved_at_step is not None and last_update["counters"]["solved_at_step"] is None:
                solved_since = {k: getattr(counters, k) for k in _SOLVED}
            fresh = not updating and (last_update["counters"]["global_step"] != self.saved_step or bool(solved_since))
            last_update = {**last_update, "counters": {**last_update["counters"], **solved_since}}
            # (none before the run's first update: a checkpoint of nets that never learned, at step 0, would
            # only be resumed as a run started over, which --resume of a run dir without one does anyway)
            state = last_update if fresh and last_update["counters"]["update"] > 0 else None
            counters = Counters(**last_update["counters"])
        try:
            if state is not None:
                self.save(stop_reason or "end", state)
        except Exception as err:
            if stop_reason is None or not stop_reason.startswith(("error", "interrupted", "stopped")):
                raise
            if isinstance(err, RunDirWriteError):
                self.log.error("could not write the last checkpoint: %s", err)
            else:
                self.log.exception("could not write the last checkpoint")
        return counters
