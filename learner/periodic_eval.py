"""``learner train --eval-every N``: the current policy evaluated every N env steps, as SB3's ``EvalCallback``
(RL Zoo's ``--eval-freq``) does, on envs of its own.

Training's returns are those of the stochastic policy, over episodes played by nets a few updates old; an
evaluation plays ``--eval-episodes`` episodes of the current nets' deterministic policy (the mode of their
distribution, as ``learner eval``), with the --norm-obs statistics as they are (applied, never updated), and
reports the envs' own returns (no --clip-reward, no --norm-reward). The episodes are :func:`learner.evaluate`'s
loop (:func:`~learner.evaluate.play_episodes`), on an extra local env server (the training servers' env,
kwargs, wrappers and time limit), in process (--backend gym), or on --eval-servers (a run on --servers: a
server serves one learner at a time, so the training fleet has no envs to lend).

It leaves training as it would be without it: its envs are not the training envs, its seeds are far from
theirs, the policy's mode draws nothing, and the random generators (Python's, NumPy's, torch's) are put back
as they were after each evaluation in case anything drew; so a run with ``--eval-every`` learns exactly what the
same run without it learns, and a resumed run evaluates at the same steps with the same seeds. An evaluation cut
short by a stop (Ctrl-C, SIGTERM, SIGHUP), or a solved run's final one by a kill (its checkpoint is written before
it), is due in the step's checkpoint (its counters' ``due``): a --resume plays it first (:meth:`PeriodicEval.redo`),
as it would have been played; one killed mid-run is past the last checkpoint, and played when the run gets there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch

from learner.checkpoint import capture_rng, restore_rng
from learner.config import Args
from learner.discovery import expand_addresses, probe, split_addresses
from learner.envs import FleetSpec, open_fleet
from learner.errors import EnvFleetError, ServerUnavailableError
from learner.evaluate import play_episodes, policy_of
from learner.local import label_of, left_down
from learner.normalize import DictRunningMeanStd, RunningMeanStd
from learner.ppo import Agent
from learner.progress import StopRequest
from learner.resume import Counters
from learner.stats import format_returns, mean_of, spread_of

if TYPE_CHECKING:
    from learner.records import Recorder

__all__ = [
    "EVAL_COLUMNS",
    "EVAL_LABEL_PREFIX",
    "EVAL_SEED_BASE",
    "PeriodicEval",
    "eval_fleet",
    "open_eval_envs",
    "policy_as_of",
]

log = logging.getLogger(__name__)

EVAL_SEED_BASE = 2**48
"""Evaluation envs are reset with ``EVAL_SEED_BASE + --seed + global_step`` (env i: plus i): training's env i
gets ``--seed + i`` (a resumed run ``--seed + global_step + i``), at most about 2**33, so the two never meet;
each evaluation's seeds are its own (its step differs), and the same in a run resumed or repeated."""

EVAL_LABEL_PREFIX = "eval"
"""The evaluation's local server is ``eval-0`` (learner.local.server_label): its log lines and errors, and its
forwarded ``env_server[eval-0]`` lines, told apart from the training servers' ``local-N``."""

DOWN_PROBE_S = 1.0
"""After an evaluation failed as its --eval-servers server did not answer, how long the next ones try a plain
connection to it before they are left out (PeriodicEval._still_down), not --connect-timeout."""

EVAL_COLUMNS = ("eval/return_mean", "eval/return_std", "eval/length_mean", "eval/episodes", "eval/seconds")
"""The columns an evaluation adds to the metrics.jsonl row of the update it ran at."""


def eval_fleet(args: Args, fleet: FleetSpec, env_id: str) -> FleetSpec:
    """Where ``args``' evaluations run (``fleet``: the training envs', ``env_id`` their env): on --eval-servers,
    else as the training envs are made (one more local server of the same env, kwargs, wrappers and time limit;
    in process for --backend gym), with --eval-envs envs. Not fault-tolerant: an episode cut short by a lost
    server is no sample of the return (the evaluation is then skipped, with a warning)."""
    n = args.eval_num_envs()
    if args.eval_servers is not None:
        return dataclasses.replace(
            fleet,
            env=env_id,
            servers=args.eval_servers,
            backend="remote",
            num_servers=1,
            envs_per_server=n,
            pipeline_groups=1,
            fault_tolerant=False,
        )
    # (its server is eval-0, not a second local-0 beside training's: their log lines and errors told apart)
    return dataclasses.replace(
        fleet,
        env=env_id,
        num_servers=1,
        envs_per_server=n,
        pipeline_groups=1,
        fault_tolerant=False,
        label_prefix=EVAL_LABEL_PREFIX,
    )


@contextlib.contextmanager
def open_eval_envs(spec: FleetSpec, env_id: str, envs: gym.vector.VectorEnv, servers: str | None = None) -> Any:
    """The evaluation envs ``spec`` says (closed when the block ends), checked to be the training ``envs``' env
    (``env_id``) with their spaces: ValueError naming --eval-servers (or the envs) otherwise. ``servers``: the
    training envs' --servers as written (None: the run's own servers), for that error to name them so."""
    if spec.servers is not None:
        _check_not_training_servers(spec, envs, servers)
    with open_fleet(spec) as made:
        served = getattr(made, "env_id", None)
        where = f"--eval-servers: the servers at {spec.servers}" if spec.servers is not None else "the eval envs"
        if served and served != env_id:
            raise ValueError(f"{where} serve {served}, but the run trains on {env_id}; give servers of {env_id}")
        for what in ("observation", "action"):
            mine, theirs = getattr(envs, f"single_{what}_space"), getattr(made, f"single_{what}_space")
            if str(mine) != str(theirs):
                raise ValueError(
                    f"{where} have {what}s {theirs}, but the training envs have {mine}: start them as the training "
                    "servers (the same wrappers and env kwargs)"
                )
        yield made


def _check_not_training_servers(spec: FleetSpec, envs: gym.vector.VectorEnv, servers: str | None = None) -> None:
    """ValueError naming --servers and --eval-servers where one of ``spec``'s servers (--eval-servers) is one of the
    training ``envs``' under another name (``localhost:5000`` and ``127.0.0.1:5000``, a host name and its address, a
    ``dns:`` or ``compose:`` name and an address behind it), as ``learner servers`` and the fleet tell them: by the
    server id each reports (GetSpec, which claims nothing). Args compares the addresses as written; such a pair
    passed, and the evaluation's handshake was then refused by the server's claim, with an error that says to close
    a RemoteVectorEnv of this process, which a user of the command cannot do. Servers that do not answer, or too old
    to report an id, are left to the connection's own errors.

    Each side is named as it was written (``servers``: --servers as given), with the address it led to where that
    is another (:func:`_as_written`): the fleets report the addresses they reached, and ``--servers
    dns:///localhost:5000`` with ``--eval-servers 127.0.0.1:5000`` was refused as "--eval-servers 127.0.0.1:5000
    and --servers 127.0.0.1:5000 are the same env server ..., written two ways": the two ways, as said, one."""
    training = {s.server_id: s.address for s in getattr(envs, "replica_stats", list)() if s.server_id}
    if not training:
        return
    from learner.survey import survey  # (here: a run without --eval-servers has no use for it)

    answers = survey(
        spec.servers or "",
        timeout=min(spec.connect_timeout, 5.0),
        auth_token=spec.auth_token,
        tls=spec.tls,
        tls_server_name=spec.tls_server_name,
        tls_client_cert=spec.tls_client_cert,
        tls_client_key=spec.tls_client_key,
    )
    shared = [(training[info.server_id], info) for info in answers if info.server_id in training]
    if shared:
        pairs = "; ".join(
            f"--eval-servers {_as_written(spec.servers or '', info.address)} and "
            f"{'the training server ' + address if servers is None else '--servers ' + _as_written(servers, address)}"
            f" are the same env server (server id {info.server_id[:8]}), written two ways"
            for address, info in shared
        )
        raise ValueError(
            f"{pairs}: a server serves one learner connection at a time, and the training servers serve its "
            "rollouts: give --eval-servers other running servers of the same env"
        )


def _as_written(servers: str, address: str) -> str:
    """The entry of ``servers`` (an option's value as given: ``host:port,dns:///name:port,...``) that led to
    ``address``, one of the servers it names: the entry itself where it is that address (``localhost:5000``),
    else the entry and the address behind it (``dns:///localhost:5000 (at 127.0.0.1:5000)``; an entry looked up
    again, as the fleet looked it up: for an error, once). One found by none of them now (a name that resolves
    elsewhere since) is said as behind the whole of ``servers``."""
    entries = split_addresses(servers)
    if address in entries:
        return address
    for entry in entries:
        try:
            if address in expand_addresses(entry):
                return f"{entry} (at {address})"
        except (EnvFleetError, ValueError, OSError):  # (an entry that no longer resolves: not the one)
            continue
    return f"{servers.strip()} (at {address})"


def policy_as_of(
    agent: Agent,
    obs_rms: RunningMeanStd | DictRunningMeanStd | None,
    state: dict[str, Any] | None,
    envs: gym.vector.VectorEnv,
    device: torch.device,
) -> Callable[..., Any]:
    """The deterministic policy (the mode, as learner eval plays it) of ``agent``'s nets as they are, on ``envs``'
    spaces, normalising with the --norm-obs statistics ``state`` holds (the run's state the nets go with:
    --overlap-update's as of the end of the rollout the update learned from, a run's last update's), else the live
    ``obs_rms``: an evaluation's (:meth:`PeriodicEval.run`) and --capture-video's (VideoCapture.record), alike."""
    if state is not None and obs_rms is not None and state.get("obs_rms") is not None:
        obs_rms = copy.deepcopy(obs_rms)  # (a copy: the live statistics go on as the rollouts make them)
        obs_rms.load_state_dict(state["obs_rms"])
    return policy_of(agent, obs_rms, envs, device, deterministic=True)


@dataclasses.dataclass(eq=False)
class PeriodicEval:
    """The evaluations of a run (--eval-every): :meth:`due` at an update, :meth:`run` there."""

    args: Args
    envs: gym.vector.VectorEnv
    fleet: FleetSpec
    agent: Agent
    """The nets trained (the updated ones, not --overlap-update's acting copy)."""
    obs_rms: RunningMeanStd | DictRunningMeanStd | None
    device: torch.device
    stop: StopRequest
    counters: Counters
    total_timesteps: int
    last_step: int
    """The env steps of the last update recorded (a resumed run's: its checkpoint's): an evaluation is due at
    the first update past each multiple of --eval-every."""
    save_best: Callable[[dict[str, Any] | None, bool], Path] | None
    """Writes checkpoints/best-eval.pt of the nets as they are, with the state :meth:`run` was given (None: the
    run's as of now) and whether the update evaluated is counted in it already (:meth:`run`'s ``counted``);
    None: --no-save-best."""
    shown: Recorder | None = None
    """Where the run is shown and recorded: its progress bar or lines say each evaluation while it runs
    (:meth:`Recorder.evaluating <learner.records.Recorder.evaluating>`), then the last update's figures again; a
    solved run's :meth:`final` evaluation goes into its last update's row. None: neither (no final evaluation)."""
    filming: Callable[[], bool] | None = None
    """--capture-video: whether its videos are still recorded (none after one failed), for the warnings of
    evaluations left out (:meth:`_videos_go_on`); None: no --capture-video."""
    server_gone: bool = dataclasses.field(default=False, init=False)
    """Whether the evaluation's local server was found left down (see :meth:`run`)."""
    stopped: bool = dataclasses.field(default=False, init=False)
    """Whether the last evaluation :meth:`run` was asked for was cut short (or not begun) by a stop (Ctrl-C,
    SIGTERM, SIGHUP): it is still due at its step (:attr:`Counters.due <learner.resume.Counters.due>`, which the
    step's checkpoint holds, and a --resume does first); one left out as its env failed or its server is down is
    not."""
    unanswered: str | None = dataclasses.field(default=None, init=False)
    """The --eval-servers server an evaluation failed for, unavailable (it did not answer within --connect-timeout,
    or was lost), until an evaluation runs again (see :meth:`_still_down`)."""

    def due(self, step: int) -> bool:
        """Whether the update whose rollout ended at env step ``step`` is evaluated: the first at or past a
        multiple of --eval-every, or the run's last (--total-timesteps reached) where an evaluation ran before
        (this session or an earlier one)."""
        every, last = self.args.eval_every, self.last_step
        self.last_step = step
        if step // every > last // every:
            return True
        return step >= self.total_timesteps and self.counters.best_eval_step is not None

    def _left_down(self, step: int) -> bool:
        """Whether the evaluation's local server was left down (its supervisor started it again too often
        within a minute: learner.local.left_down): the evaluation at ``step`` and every later one are left out at
        once, said once. Each waited --connect-timeout for it (10 s by default) and failed, a warning each that
        did not say why nor that it would go on so; training stalled that long at every evaluation."""
        if self.server_gone:
            return True
        for address in getattr(self.envs, "addresses", None) or ():
            why = left_down(address)
            if why is not None:
                self.server_gone = True
                log.warning(
                    "the eval server %s %s: the evaluations from step %s on are left out (training goes on%s)",
                    label_of(address),
                    why,
                    f"{step:,}",
                    self._videos_go_on("their videos are"),
                )
                return True
        return False

    def _videos_go_on(self, which: str) -> str:
        """What a warning of an evaluation left out adds with --capture-video: ``which`` (its video, or theirs)
        recorded all the same. Its env is in the learner's process, not the evaluation's (an eval server left down,
        or one that failed): the video is the look at the policy there that is left (and at the run's end, where it
        is filmed without --eval-every too). "" without --capture-video, or once a video failed (no more are
        recorded: the warning said they were)."""
        return (
            f"; {which} recorded all the same, --capture-video playing in this process"
            if self.filming is not None and self.filming()
            else ""
        )

    def _still_down(self, step: int) -> bool:
        """Whether the eval server an evaluation failed for (:attr:`unanswered`: it did not answer within
        --connect-timeout, or was lost) still refuses a plain connection (:func:`~learner.discovery.probe`, within
        :data:`DOWN_PROBE_S`): then the evaluation at ``step`` is left out at once, said in an INFO line. Each
        evaluation on a down --eval-servers server waited the whole --connect-timeout (10 s by default) and failed,
        training stalled that long at each (18 evaluations of a 40,000-step CartPole run: 3 min 33 s where the run
        takes ~15 s). A server that does not run refuses a connection at once; one that listens (back, or building
        its envs) is tried as before, with its whole wait. (--eval-servers only: the local eval server is restarted
        by its supervisor, and :meth:`_left_down` leaves it out once that gives up on it.)"""
        address = self.unanswered
        if address is None:
            return False
        why = probe(address, DOWN_PROBE_S, peek=False)
        if why is None:
            return False
        log.info(
            "the evaluation at step %s is left out: the eval server %s still does not answer (%s)",
            f"{step:,}",
            label_of(address),
            why,
        )
        return True

    def run(self, step: int, state: dict[str, Any] | None = None, *, counted: bool = False) -> dict[str, Any]:
        """Evaluate the nets as they are now, for the row of the update at env step ``step``: its eval/ columns
        (:data:`EVAL_COLUMNS`); none where it was stopped (Ctrl-C: the run stops next, as during a rollout) or
        an env failed (a warning: training goes on without it).

        ``state``: the run's state as of the end of the rollout that update learned from
        (Checkpointer.rollout_state()'s, which its checkpoint will hold), where the run has moved on since:
        --overlap-update evaluates an update once it is done in the background, after the next rollout, whose
        observations have updated the --norm-obs statistics. The evaluation normalises with the statistics
        ``state`` holds (those the nets were trained with, and the step's checkpoint and best-eval.pt hold: learner
        eval of either plays the same episodes), and counts itself in ``state``'s counters (as the step's
        checkpoint of a run without --overlap-update counts it). None: the run's as they are now.

        ``counted``: the update evaluated is recorded already, and ``state`` is the state it ended with
        (Checkpointer.last_update: a run solved in the rollout after it, evaluated as it stops); else the update is
        recorded after its evaluation, with these columns."""
        self.stopped = False
        if self._left_down(step) or self._still_down(step):
            return {}
        started = time.perf_counter()
        rng = capture_rng()  # (put back after: nothing here may change what training draws next)
        seed = EVAL_SEED_BASE + self.args.seed + step
        policy = policy_as_of(self.agent, self.obs_rms, state, self.envs, self.device)
        shown, episodes = self.shown, self.args.eval_episodes
        try:
            returns, lengths, cut = play_episodes(
                self.envs,
                self.fleet,
                policy,
                episodes,
                seed,
                self.stop,
                progress=False,
                # (the bar, or a line at the lines' period, says it while it runs: else it looked hung)
                on_step=None if shown is None else lambda ended: shown.evaluating(step, ended, episodes),
            )
        except EnvFleetError as err:
            # (--eval-servers only: a local eval server is restarted by its supervisor, which _left_down follows)
            remote = isinstance(err, ServerUnavailableError) and self.args.eval_servers is not None
            self.unanswered = (getattr(err, "address", None) or None) if remote else None
            later = (
                f" (the next evaluations try it for {DOWN_PROBE_S:g} s first, and are left out at once while it is "
                "down)"
                if self.unanswered
                else ""
            )
            log.warning(
                "the evaluation at step %s failed, and is left out (training goes on%s): %s%s",
                f"{step:,}",
                self._videos_go_on("its video is"),
                err,
                later,
            )
            return {}
        finally:
            restore_rng(rng)
            if shown is not None:
                shown.evaluated()
        self.unanswered = None  # (its server answered: the next evaluation waits for it as long as it needs)
        seconds = time.perf_counter() - started
        if cut or not returns:
            self.stopped = True  # (still due: the step's checkpoint says so, and a --resume does it first)
            log.info("the evaluation at step %s was stopped: left out (a --resume does it first)", f"{step:,}")
            return {}
        mean, std = mean_of(returns), spread_of(returns)
        columns = {
            "eval/return_mean": mean,
            "eval/return_std": std,
            "eval/length_mean": float(np.mean(lengths)),
            "eval/episodes": len(returns),
            "eval/seconds": round(seconds, 4),
        }
        log.info(
            "eval at step %s: %s over %d episode%s, %.1f s",
            f"{step:,}",
            " +- ".join(format_returns(mean, std)),
            len(returns),
            "" if len(returns) == 1 else "s",
            seconds,
        )
        counters = self.counters
        counters.eval_return_mean = mean
        best = counters.best_eval_return
        new_best = math.isfinite(mean) and (best is None or mean > best)
        if new_best:
            counters.best_eval_return, counters.best_eval_step = mean, step
        if state is not None:  # (done: not due, as best-eval.pt, written from it next, says)
            state["counters"].update(
                eval_return_mean=mean,
                best_eval_return=counters.best_eval_return,
                best_eval_step=counters.best_eval_step,
                due=[what for what in state["counters"].get("due") or () if what != "eval"],
            )
        if new_best and self.save_best is not None:
            path = self.save_best(state, counted)
            log.debug("best evaluation so far (%s at step %d): %s", format_returns(mean)[0], step, path)
        return columns

    def final(self, state: dict[str, Any]) -> None:
        """A run stopped by --stop-at-return: the nets it ends with (its last update's: the rollout it was solved in
        is not learned from), evaluated once, unless that update's were (an evaluation was due there), and recorded
        as an evaluation at that update is (its row's eval/ columns, :meth:`Recorder.add_evaluation
        <learner.records.Recorder.add_evaluation>`; summary.json; best-eval.pt where best), with ``state``, the one
        that update ended with (Checkpointer.last_update, which the run's last checkpoint holds: it counts the
        evaluation too). Else summary.json's eval_return_mean was an older policy's, or none. Nothing before any
        update of this session (no row to add it to), but for a resumed session that redid its checkpoint's
        evaluation cut short (:meth:`redo`), whose row it is.

        That checkpoint is written before it, with the evaluation (and the end's video) as due in its counters
        (:attr:`Counters.due <learner.resume.Counters.due>`): a learner killed or stopped meanwhile is resumed as
        solved, and the --resume does them (:meth:`redo`), then ends as this run would have."""
        self.stopped = False
        if self.shown is not None and "eval/return_mean" not in self.shown.last_row:  # (its own evaluation: none)
            self.redo(state)

    def redo(self, state: dict[str, Any]) -> None:
        """--resume of a checkpoint whose evaluation was due and not done (cut short by a stop, or a solved run's
        final one by a kill: :attr:`Counters.due <learner.resume.Counters.due>`): that evaluation, of its nets and
        --norm-obs statistics (the session's as restored, ``state``, Checkpointer.last_update), seeded as it
        would have been, recorded where it would have been (the checkpoint's row, which the shown Recorder's
        last_row is: its eval/ columns, TensorBoard, W&B, the gauge, the bar; summary.json and best-eval.pt where
        best; ``state``'s counters, which the next checkpoint holds). :attr:`stopped` says whether a stop cut it
        short again. (:meth:`final` too, for the nets a solved run ends with: the same evaluation of the last row's.)"""
        self.stopped = False
        if self.shown is None or not self.shown.last_row:
            return
        evaluation = self.run(int(self.shown.last_row["global_step"]), state, counted=True)
        if evaluation:
            self.shown.add_evaluation(evaluation)
