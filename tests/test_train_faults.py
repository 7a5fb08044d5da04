"""Training through failures: env servers killed and restarted under `learner train`, and the learner itself
killed with SIGKILL and resumed."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import rundir
from learner.checkpoint import load_checkpoint
from tests.conftest import CTRL_C_EXIT, ServerProcess, SpawnServer

if TYPE_CHECKING:
    import threading

    from learner.config import Args

pytestmark = pytest.mark.slow

K = 2
NUM_STEPS = 16
# (a checkpoint after every update, not every 30 s: the SIGKILLed runs below resume from their last one)
TRAIN = ["--num-steps", str(NUM_STEPS), "--no-plot", "--no-progress", "--no-tensorboard", "--seed", "3"]
TRAIN += ["--checkpoint-seconds", "0"]


def learner(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "learner", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / rundir.METRICS
    return rundir.read_jsonl(path) if path.exists() else []


def wait_for(proc: subprocess.Popen[str], condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no {what} within {timeout:g} s:\n{err[-4000:]}")
        time.sleep(0.1)


def test_training_goes_on_while_a_server_is_killed_and_restarted(spawn_server: SpawnServer, tmp_path: Path) -> None:
    """Server b is SIGKILLed mid-run and comes back 2 s later: training never stops, b's envs' steps stay out of
    the batch while it is away, and metrics.jsonl counts the failure, the reconnect and the steps lost."""
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    c = spawn_server("CartPole-v1", K)
    run_dir = tmp_path / "run"
    servers = f"{a.address},{b.address},{c.address}"
    proc = learner(
        "--servers", servers, "--timeout", "2", "--total-timesteps", "100000000", "--run-dir", str(run_dir), *TRAIN
    )
    try:
        wait_for(proc, lambda: len(rows(run_dir)) >= 3, "3 updates")
        b.kill()
        killed_at = len(rows(run_dir))
        wait_for(proc, lambda: len(rows(run_dir)) >= killed_at + 5, "5 updates with a server down")
        b.start()
        wait_for(proc, lambda: any(r.get("faults/reconnects") for r in rows(run_dir)), "the reconnect")
        back_at = len(rows(run_dir))
        wait_for(proc, lambda: len(rows(run_dir)) >= back_at + 3, "3 updates after the reconnect")
    finally:
        proc.send_signal(signal.SIGINT)  # stop at the next step, with a checkpoint and summary
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == CTRL_C_EXIT, out + err
    assert "Traceback" not in err, err
    metrics = rows(run_dir)
    full = 3 * K * NUM_STEPS
    assert all(int(r["batch_size"]) + int(r["env_steps_lost"]) <= full for r in metrics)
    down = [r for r in metrics if r["envs_unavailable"] == K]
    assert down, "an update ended with b's envs unavailable"
    # An update with b away all along learns from a and c's envs only.
    assert any(int(r["batch_size"]) <= 2 * K * NUM_STEPS and r["env_steps_lost"] == K * NUM_STEPS for r in metrics)
    assert sum(int(r.get("faults/failures", 0)) for r in metrics) == 1
    assert sum(int(r.get("faults/reconnects", 0)) for r in metrics) == 1
    assert sum(int(r.get("faults/server_restarts", 0)) for r in metrics) == 1
    assert metrics[-1]["envs_unavailable"] == 0 and metrics[-1]["env_steps_lost"] == 0
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert (summary["failures"], summary["reconnects"]) == (1, 1)
    assert summary["env_steps_lost"] >= 5 * K * NUM_STEPS
    assert "env server" in err and "lost" in err and "is back" in err
    # The closing lines say what the failure cost.
    share = summary["env_steps_lost"] / summary["total_steps"]
    assert (
        f"faults: 1 server failure, 1 reconnect, 1 server restart, {summary['env_steps_lost']:,} env steps lost "
        f"({share:.1%} of the run's)"
    ) in out, out


def test_learner_killed_with_sigkill_resumes_losing_at_most_the_update_in_progress(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = ["--num-servers", "1", "--envs-per-server", str(K)]
    proc = learner(*local, "--total-timesteps", "100000000", "--run-dir", str(run_dir), *TRAIN)
    try:
        wait_for(proc, lambda: len(rows(run_dir)) >= 6, "6 updates")
    finally:
        proc.kill()  # SIGKILL: no checkpoint on the way out, no summary
        proc.communicate(timeout=60)
    assert not (run_dir / rundir.SUMMARY).exists()
    logged = max(int(r["update"]) for r in rows(run_dir))
    checkpoint = load_checkpoint(run_dir)
    saved = int(checkpoint["counters"]["update"])
    # Updates are checkpointed as they end: what is lost is at most the update being written or run.
    assert saved >= logged - 1, (saved, logged)
    # A write cut short leaves a temporary file; resuming clears it.
    stale = rundir.checkpoint_path(run_dir, 10**9).with_name(".step-x.pt.abc.tmp")
    stale.write_bytes(b"half a checkpoint")

    total = (saved + 3) * K * NUM_STEPS
    resumed = subprocess.run(
        [sys.executable, "-m", "learner", "train", "--resume", str(run_dir), "--total-timesteps", str(total)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not stale.exists()
    updates = [int(r["update"]) for r in rows(run_dir)]
    assert updates == list(range(1, saved + 4)), updates  # no gap, no update twice
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert summary["total_steps"] == total and summary["updates"] == saved + 3


def test_a_resumed_run_counts_the_faults_of_the_whole_run(spawn_server: SpawnServer, tmp_path: Path) -> None:
    """A server killed and restarted (1 failure, 1 reconnect, 1 restart), then the learner SIGKILLed and
    resumed: the checkpoint carries the fault counts, and the resumed run's summary and closing line add its
    own to them, next to the env steps lost and episodes cut it carries too."""
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    run_dir = tmp_path / "run"
    servers = f"{a.address},{b.address}"
    proc = learner(
        "--servers", servers, "--timeout", "2", "--total-timesteps", "100000000", "--run-dir", str(run_dir), *TRAIN
    )
    try:
        wait_for(proc, lambda: len(rows(run_dir)) >= 2, "2 updates")
        b.kill()
        wait_for(proc, lambda: any(r["envs_unavailable"] for r in rows(run_dir)), "an update with b down")
        b.start()
        wait_for(proc, lambda: any(r.get("faults/reconnects") for r in rows(run_dir)), "the reconnect")
        back_at = len(rows(run_dir))
        wait_for(proc, lambda: len(rows(run_dir)) >= back_at + 2, "2 updates after the reconnect")
    finally:
        proc.kill()  # SIGKILL: no checkpoint on the way out, no summary
        proc.communicate(timeout=60)
    counters = load_checkpoint(run_dir)["counters"]
    assert (counters["failures"], counters["reconnects"], counters["server_restarts"]) == (1, 1, 1), counters
    lost, cut = counters["env_steps_lost"], counters["episodes_cut"]
    assert lost > 0

    total = counters["global_step"] + 2 * 2 * K * NUM_STEPS
    resumed = subprocess.run(
        [sys.executable, "-m", "learner", "train", "--resume", str(run_dir), "--total-timesteps", str(total)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert (summary["failures"], summary["reconnects"], summary["server_restarts"]) == (1, 1, 1), summary
    assert (summary["env_steps_lost"], summary["episodes_cut"]) == (lost, cut)
    assert summary["shutdowns"] == summary["servers_joined"] == summary["servers_left"] == 0
    assert "faults: 1 server failure, 1 reconnect, 1 server restart, " in resumed.stdout, resumed.stdout
    # metrics.jsonl counts each fault once, in the update it happened in (per update, as the summary totals).
    metrics = rows(run_dir)
    assert sum(int(r.get("faults/failures", 0)) for r in metrics) == 1
    assert sum(int(r["episodes_cut"]) for r in metrics) == cut
    assert sum(int(r["env_steps_lost"]) for r in metrics) == lost


def test_a_run_that_reaches_its_budget_without_an_update_is_an_error(spawn_server: SpawnServer, tmp_path: Path) -> None:
    """Its only server killed as the run starts (fault-tolerant, --give-up-after far off): every rollout is
    cut short or stepped while the fleet is down, and the budget runs out with no update. That is no run
    that did what it was asked, nor a policy to evaluate: NothingToLearnError, not a finished run."""
    from learner.config import Args
    from learner.train import NothingToLearnError, train
    from tests.conftest import QUIET

    server = spawn_server("CartPole-v1", 2)
    args = Args(
        servers=server.address,
        num_steps=2,
        total_timesteps=12,
        give_up_after=600,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )

    def kill_server(_: dict[str, Any]) -> None:
        server.kill()

    with pytest.raises(
        NothingToLearnError, match=r"^the run reached --total-timesteps \(12\) without an update: every"
    ):
        train(args, on_start=kill_server)
    summary = rundir.read_json(tmp_path / "run" / rundir.SUMMARY)
    assert summary["updates"] == 0 and summary["stop_reason"].startswith("error: NothingToLearnError: the run reached")


@pytest.mark.slow
def test_a_ctrl_c_during_a_step_that_then_fails_stops_the_run_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without --fault-tolerant, the hung step's deadline error that follows a Ctrl-C ended the rollout as
    one to drop, "going on without env server ..." (the run then stopped, as asked): now it says it stops."""
    import json
    import os

    from learner.cli import main

    kwargs = {"signal_pid": os.getpid(), "signal_at": 20, "hang_s": 9.0}
    argv = ["train", "--env", "tests.eval_envs:StopThenHangEnv", "--env-kwargs", json.dumps(kwargs)]
    argv += ["--num-servers", "1", "--envs-per-server", "1", "--num-steps", "8", "--total-timesteps", "200"]
    argv += ["--timeout", "3", "--no-fault-tolerant", "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--no-progress", "--no-plot", "--no-tensorboard"]) == 130
    said = caplog.text
    assert "the step under way when the stop was asked failed: env server " in said, said
    assert "dropping this rollout" not in said, said
    assert json.loads((tmp_path / "run" / rundir.SUMMARY).read_text())["stop_reason"] == "interrupted"


@pytest.mark.parametrize("shown", ["lines", "bar"])
def test_the_progress_lines_and_bar_say_while_servers_are_down_or_have_not_joined(
    shown: str,
    spawn_server: SpawnServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Server c is down as the run starts (the start goes on without it), then started, and joins; then b is
    SIGKILLed and started again. Each update's progress line (without a terminal), or the bar drawn at each
    update, ends in what the fleet is missing as of that update, and in nothing once it is whole again: a
    glance at the bar or at a CI log's lines showed nothing of it but a lower SPS (the warnings said so at
    the time, then less and less often)."""
    import threading

    from tqdm import tqdm

    from learner import train as train_module
    from learner.config import Args
    from learner.progress import fleet_note
    from learner.train import train

    a, b, c = (spawn_server("CartPole-v1", K) for _ in range(3))
    c.kill()  # (listed, not answering: the start goes on without it)
    if shown == "lines":
        monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 0.0)  # (a line at every update; 60 s in use)
    else:  # (drawn at every update, not at tqdm's mininterval)
        monkeypatch.setattr("learner.progress._tqdm_class", lambda: lambda **kwargs: tqdm(**kwargs, mininterval=0.0))
    stop = threading.Event()
    phases: list[int] = []  # (the update at which each step below was taken)
    deadline = time.monotonic() + 120

    def on_update(row: dict[str, Any]) -> None:
        down, missing = row.get("faults/servers_down", 0), row.get("faults/servers_not_joined", 0)
        if time.monotonic() > deadline:
            stop.set()  # (the assertions below say which step was not reached)
        elif not phases and missing:
            c.start()  # (joins at a look-up between rollouts once it answers)
            phases.append(row["update"])
        elif len(phases) == 1 and not missing and not down:
            b.kill()
            phases.append(row["update"])
        elif len(phases) == 2 and down:
            b.start()  # (reconnected)
            phases.append(row["update"])
        elif len(phases) == 3 and not down:
            phases.append(row["update"])
        elif len(phases) == 4 and row["update"] >= phases[3] + 2:
            stop.set()

    args = Args(
        servers=f"{a.address},{b.address},{c.address}",
        num_steps=NUM_STEPS,
        total_timesteps=100_000_000,
        timeout=2.0,
        connect_timeout=2.0,
        give_up_after=600,
        seed=3,
        progress=None if shown == "lines" else True,
        plot=False,
        tensorboard=False,
        run_dir=str(tmp_path / "run"),
    )
    summary = train(args, on_update=on_update, stop=stop)
    assert summary["stop_reason"] == "stopped" and len(phases) == 4, phases
    rows = rundir.read_jsonl(tmp_path / "run" / rundir.METRICS)
    notes = [fleet_note(row) for row in rows]
    assert notes[0] == "1 server not joined", rows[0]  # (a and b in the fleet, c not)
    assert "1 of 3 servers down" in notes[phases[1] : phases[2]], notes  # (b killed: a and c up)
    assert notes[phases[3] - 1 :] == [""] * (len(rows) - phases[3] + 1), notes  # (whole again: nothing said)
    assert set(notes) == {"1 server not joined", "", "1 of 3 servers down"}, notes
    out, err = capsys.readouterr()
    if shown == "lines":
        lines = [line for line in out.splitlines() if line.startswith("step ")]
        assert len(lines) == len(rows), lines
        for line, note in zip(lines, notes, strict=True):
            # (nothing after the time left while the fleet is whole: --total-timesteps is far off)
            assert line.endswith(f" left, {note}" if note else " left"), (line, note)
    else:
        drawn = [frame.rstrip() for frame in re.split(r"[\r\n]", err) if "steps [" in frame]
        # (the note first, as the bar says every note, then the update's figures: a narrow terminal cuts those)
        assert any(re.search(r"<[^,]+, 1 server not joined, SPS [\d,]+, return [^,\]]+]$", f) for f in drawn), drawn
        assert any(re.search(r"<[^,]+, 1 of 3 servers down, SPS [\d,]+, return [^,\]]+]$", f) for f in drawn), drawn
        # (its last state, the run's final figures: the fleet whole at its last update)
        assert re.search(r", return [^,]+]$", drawn[-1]), drawn[-1]


def _outage_args(servers: list[ServerProcess], run_dir: Path, **options: Any) -> Args:
    """The Args of the outage tests' runs on ``servers`` (started by hand: the test kills them and starts them
    again on the same addresses), written to ``run_dir``: their steps' and connections' waits 2 s, giving up
    after 120 s of outage unless ``options`` say otherwise (with the run's total, its bar or lines)."""
    from learner.config import Args

    return Args(
        **{
            "servers": ",".join(server.address for server in servers),
            "num_steps": NUM_STEPS,
            "timeout": 2.0,
            "connect_timeout": 2.0,
            "give_up_after": 120,
            "seed": 3,
            "plot": False,
            "tensorboard": False,
            "run_dir": str(run_dir),
            **options,
        }
    )


def _all_killed_at_update_2(
    servers: list[ServerProcess], killed: list[float], helper: threading.Thread
) -> Callable[[dict[str, Any]], None]:
    """train()'s ``on_update`` of the outage tests: after the second update every one of ``servers`` is SIGKILLed,
    the time noted in ``killed``, and ``helper`` (the thread that starts them again later) started."""

    def on_update(row: dict[str, Any]) -> None:
        if row["update"] == 2:
            for server in servers:
                server.kill()
            killed.append(time.monotonic())
            helper.start()

    return on_update


@pytest.mark.parametrize("shown", ["lines", "bar", "stopped", "stopped_overlap"])
def test_the_progress_lines_and_bar_say_while_every_server_is_down(
    shown: str,
    spawn_server: SpawnServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Both servers, started by hand (not restarted by the learner), are SIGKILLed after the second update and
    started again on the same addresses 4 s later. Meanwhile no step counts and no update comes, and the bar
    (and the lines) stayed frozen on the last update's figures, saying nothing of the outage, as long as it
    lasted: a program that looked hung. They say that the fleet is down and for how long, refreshed while it
    lasts, then the run goes on to its end, the bar showing its figures again. "stopped": the run is stopped
    (train()'s stop event, as Ctrl-C stops it) during the outage instead: it ends at once, the bar's last state
    saying the fleet was down, no longer waiting; "stopped_overlap" so with --overlap-update, whose update of the
    last rollout before the outage, recorded as the run ended, made the bar's last state the fleet's before it.
    "lines" also serves --metrics-port and scrapes it during the outage: its gauges say every server down (they
    said the fleet was whole, the last update's); and again as the first server is back: they say so at once (they
    said every server down until the next update, minutes away where rollouts are long)."""
    import threading
    import urllib.request

    from tqdm import tqdm

    from learner import train as train_module
    from learner.live_metrics import LearnerMetrics
    from learner.records import Recorder
    from learner.train import train

    servers = [spawn_server("CartPole-v1", K) for _ in range(2)]
    if shown == "lines":
        monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 0.0)  # (a line at every update, and at each wait)
    else:  # (drawn at every update, not at tqdm's mininterval; during the outage, once a second still)
        monkeypatch.setattr("learner.progress._tqdm_class", lambda: lambda **kwargs: tqdm(**kwargs, mininterval=0.0))
    stop = threading.Event()
    outage: list[float] = []  # (when the servers were killed, then when they were started again)
    served: list[LearnerMetrics] = []
    scraped: list[str] = []
    serve_metrics = train_module.serve_metrics

    def serving(*args: Any, **kwargs: Any) -> LearnerMetrics:
        served.append(serve_metrics(*args, **kwargs))
        return served[-1]

    monkeypatch.setattr(train_module, "serve_metrics", serving)
    fleet_up = Recorder.fleet_up
    back: list[str] = []  # (/metrics as the first step after the outage found a server up)

    def scraped_as_back(recorder: Recorder, *args: Any) -> None:
        fleet_up(recorder, *args)
        if not back and served and served[0].url is not None:
            with urllib.request.urlopen(served[0].url, timeout=10) as response:
                back.append(response.read().decode())

    monkeypatch.setattr(Recorder, "fleet_up", scraped_as_back)

    def back_later() -> None:
        time.sleep(3.0)
        if served and served[0].url is not None:
            with urllib.request.urlopen(served[0].url, timeout=10) as response:
                scraped.append(response.read().decode())
        time.sleep(1.0)
        if shown.startswith("stopped"):
            stop.set()
            return
        outage.append(time.monotonic())
        for server in servers:
            server.start()

    helper = threading.Thread(target=back_later)
    on_update = _all_killed_at_update_2(servers, outage, helper)
    total = 2 * K * NUM_STEPS * 12
    args = _outage_args(
        servers,
        tmp_path / "run",
        total_timesteps=total,
        progress=None if shown == "lines" else True,
        metrics_port=0 if shown == "lines" else None,
        overlap_update=shown == "stopped_overlap",
    )
    try:
        summary = train(args, on_update=on_update, stop=stop)
    finally:
        if helper.ident is not None:
            helper.join()
    out, err = capsys.readouterr()
    waiting = re.compile(r"all 2 servers down(?: for (\d+) s)?, waiting")
    if shown == "lines":
        lines = [line for line in out.splitlines() if line.startswith("step ")]
        said = [line for line in lines if waiting.search(line)]
        # (each wait for a server, at most a second, printed one: line_every is 0 here)
        assert len(said) >= 2 and any(waiting.search(line)[1] for line in said), lines  # type: ignore[index]
        [text] = scraped
        assert "\nenvfleet_learner_servers_down 2.0\n" in text, text
        available = re.findall(r'^envfleet_learner_replica_available\{replica="[^"]+"\} (\S+)$', text, re.M)
        assert available == ["0.0", "0.0"], text
        assert f"\nenvfleet_learner_envs_unavailable {2 * K}.0\n" in text, text  # (every env, as every server)
        [text] = back  # (one server back at least; the other may be still to answer)
        available = re.findall(r'^envfleet_learner_replica_available\{replica="[^"]+"\} (\S+)$', text, re.M)
        down = re.search(r"^envfleet_learner_servers_down (\S+)$", text, re.M)
        assert "1.0" in available and down and float(down[1]) == available.count("0.0") < 2, text
        assert f"\nenvfleet_learner_envs_unavailable {K * available.count('0.0')}.0\n" in text, text
        first, last = lines.index(said[0]), lines.index(said[-1])
        assert all(waiting.search(line) for line in lines[first : last + 1]), lines  # (one outage)
        # (then the updates' lines again, as they were: "1 of 2 servers down" until the second server is back too)
        assert lines[last + 1 :] and not any("waiting" in line for line in lines[last + 1 :]), lines[last:]
        assert all(line.endswith(", waiting") and " left" not in line for line in said), said  # (no time left)
    else:
        drawn = [frame.rstrip() for frame in re.split(r"[\r\n]", err) if "steps [" in frame]
        said = [frame for frame in drawn if waiting.search(frame)]
        # (redrawn while it lasts, saying for how long: not the same frame, frozen)
        seconds = {int(match[1]) for frame in said if (match := waiting.search(frame)) and match[1]}
        assert len(seconds) >= 2, said
    if shown.startswith("stopped"):
        assert summary["stop_reason"] == "stopped", summary
        # (over: no longer waiting; said first, as while it lasted, before the run's final figures)
        assert re.search(r"<[^,]+, all 2 servers down for \d+ s, SPS [\d,-]+, return [^,\]]+]$", drawn[-1]), drawn[-1]
        return
    assert summary["stop_reason"] == "total_timesteps" and summary["total_steps"] >= total, summary
    assert len(outage) == 2, outage  # (the servers were started again)
    if shown == "bar":
        last = max(i for i, frame in enumerate(drawn) if waiting.search(frame))
        assert drawn[last + 1 :] and not any("waiting" in frame for frame in drawn[last + 1 :]), drawn[last:]


def test_the_bar_says_an_outage_whole_on_a_narrow_terminal(
    spawn_server: SpawnServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both servers, started by hand, are SIGKILLed after the second update and started again 4 s later, the bar
    drawn as on a 60-column terminal (learner train's own text bar class). It said the outage after the last
    update's SPS and return, and tqdm cuts its line at the width: under a real pty at 60 columns it read "0% 15.9k/
    100M steps, SPS 2,712, return 140.0, all 2 serve" for the whole of a 23-s outage (at 80, "... all 2 servers
    down for 10 s, wa"; with a longer step count or return, the time itself cut), a bar frozen. The note first."""
    import threading

    from tqdm import tqdm

    from learner.progress import _narrow_as_well
    from learner.train import train

    text_bar = _narrow_as_well(tqdm)  # (the text bar learner train draws, on a terminal 60 columns wide)
    monkeypatch.setattr(
        "learner.progress._tqdm_class",
        lambda: lambda **kwargs: text_bar(**{**kwargs, "dynamic_ncols": False}, ncols=60, mininterval=0.0),
    )
    servers = [spawn_server("CartPole-v1", K) for _ in range(2)]
    killed: list[float] = []

    def back_later() -> None:
        time.sleep(4.0)
        for server in servers:
            server.start()

    helper = threading.Thread(target=back_later)
    on_update = _all_killed_at_update_2(servers, killed, helper)
    # (a total that long, a bar's count as a real run's: "0% 128/10.0M steps")
    args = _outage_args(servers, tmp_path / "run", total_timesteps=10_000_000, progress=True)
    stop = threading.Event()

    def stop_once_back(row: dict[str, Any]) -> None:
        on_update(row)
        if killed and row["update"] >= 4:  # (two updates after the outage: the run need not go on)
            stop.set()

    try:
        summary = train(args, on_update=stop_once_back, stop=stop)
    finally:
        if helper.ident is not None:
            helper.join()
    assert summary["stop_reason"] == "stopped" and summary["total_steps"] > 2 * K * NUM_STEPS * 2, summary
    frames = [frame.rstrip() for frame in re.split(r"[\r\n]", capsys.readouterr().err) if " steps" in frame]
    said = [frame for frame in frames if "all 2 ser" in frame]  # (the outage's note, or what the width left of it)
    assert said and all(len(frame) <= 60 for frame in frames), frames
    # (each frame of the outage says it whole, its time redrawn: "0% 128/10.0M steps, all 2 servers down for 3 s,
    # waiting, SPS ..."), the figures after it, cut as the width wants
    notes = [
        re.search(r"% [^ ]+ steps, (all 2 servers down(?: for (\d+) s)?, waiting)(?:,|$)", frame) for frame in said
    ]
    assert all(notes), said
    assert len({match[2] for match in notes if match and match[2]}) >= 2, said


def test_a_fleet_down_before_the_first_update_still_has_that_update_printed_at_once(
    spawn_server: SpawnServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a terminal the first update's line is printed at once, the next ones a period (here 30 s) after the
    last (PROGRESS_LINE_S). Both servers are killed as the run starts and started again 2 s later: the lines say
    the fleet is down, waiting; then the first update's line came only a period after that waiting line (the
    waiting line counted as the first), past the end of a run this short: a log showed no update at all."""
    import threading

    from learner import train as train_module
    from learner.train import train

    monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 30.0)
    servers = [spawn_server("CartPole-v1", K) for _ in range(2)]

    def back_later() -> None:
        time.sleep(2.0)
        for server in servers:
            server.start()

    helper = threading.Thread(target=back_later)

    def on_start(config: dict[str, Any]) -> None:
        for server in servers:
            server.kill()
        helper.start()

    args = _outage_args(servers, tmp_path / "run", total_timesteps=2 * K * NUM_STEPS * 3, give_up_after=60)
    try:
        summary = train(args, on_start=on_start)
    finally:
        if helper.ident is not None:
            helper.join()
    assert summary["stop_reason"] == "total_timesteps", summary
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines and lines[0].endswith(", waiting"), lines  # (the outage, before any update)
    assert any(not line.endswith(", waiting") for line in lines[1:]), lines  # (then the first update's, at once)


@pytest.mark.parametrize("ending", ["back", "stopped"])
def test_tensorboard_says_when_every_server_was_down_and_for_how_long(
    ending: str, spawn_server: SpawnServer, tmp_path: Path
) -> None:
    """Both servers, started by hand, are SIGKILLed after the second update and started again 3 s later ("back"),
    or the run is stopped 3 s into the outage (train()'s stop event, as Ctrl-C stops it). No update comes while
    every server is down, and TensorBoard got nothing: its charts just stopped, while the bar said "all 2 servers
    down for 3 s, waiting". Its event files now say it: fleet/servers (servers up) falls to 0 and
    faults/servers_down rises to 2 at the env step the run was at, then (back) fleet/servers rises again at the
    same step; a ``fleet`` text at that step says the outage and how long it lasted (a step axis shows none of
    that time), and how it ended."""
    import threading

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.train import train

    servers = [spawn_server("CartPole-v1", K) for _ in range(2)]
    stop = threading.Event()
    killed: list[float] = []

    def later() -> None:
        time.sleep(3.0)
        if ending == "stopped":
            stop.set()
            return
        for server in servers:
            server.start()

    helper = threading.Thread(target=later)
    on_update = _all_killed_at_update_2(servers, killed, helper)
    run = tmp_path / "run"
    args = _outage_args(servers, run, total_timesteps=2 * K * NUM_STEPS * 5, tensorboard=True, progress=False)
    try:
        summary = train(args, on_update=on_update, stop=stop)
    finally:
        if helper.ident is not None:
            helper.join()
    assert summary["stop_reason"] == ("stopped" if ending == "stopped" else "total_timesteps"), summary
    metrics = rows(run)
    at = metrics[1]["global_step"]  # (the second update's: the servers were killed as it was recorded)
    events = EventAccumulator(str(run)).Reload()
    up = [(e.step, e.value) for e in events.Scalars("fleet/servers")]
    down = [(e.step, e.value) for e in events.Scalars("faults/servers_down")]
    # (the updates' values, 2 up; then the outage's at the step the run was at as it began, where faults/servers_down
    # starts, as a faults/ tag starts at its first fault)
    assert up[:2] == [(at - 2 * K * NUM_STEPS, 2.0), (at, 2.0)], up
    [began] = [s for s, v in up if v == 0.0]
    assert at <= began < at + 2 * K * NUM_STEPS and down[0] == (began, 2.0), (up, down)
    (text,) = events.Tensors("fleet/text_summary")
    said = text.tensor_proto.string_val[0].decode()
    assert text.step == began, (text.step, began)
    seconds = re.fullmatch(rf"all 2 servers down for (\d+) s at step {began:,}; (.*)", said)
    assert seconds and 2 <= int(seconds[1]) <= 60, said
    if ending == "stopped":
        assert seconds[2] == "the run ended then (stopped)", said
        assert up[-1] == (began, 0.0), up  # (no update after it)
        return
    assert seconds[2] in ("then 1 of 2 back", "then all back"), said
    # (back: fleet/servers rises at once, as the first server is back, not at the next update; faults/servers_down
    # falls with it. The steps taken meanwhile, each waiting for a server, count: no transition came of them.)
    (back, first), after = up[up.index((began, 0.0)) + 1], up[up.index((began, 0.0)) + 2]
    assert began <= back < after[0] and first >= 1.0 and (back, 2.0 - first) in down, (up, down)
    # (then the updates' again, to the last, the second server back by then or not)
    last = metrics[-1]["global_step"]
    assert up[-1][0] == down[-1][0] == last and up[-1][1] + down[-1][1] == 2.0, (up, down)
