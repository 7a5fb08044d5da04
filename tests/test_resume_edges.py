"""--resume at its edges: servers of another task, a run dir whose step checkpoints went, a damaged config.json,
a move onto --servers, options that did not apply to the run's envs, a device the host has not."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.config import Args
from learner.local import DEFAULT_TRANSPORT
from learner.resume import like_args, resume_args
from learner.train import train
from tests.conftest import QUIET, StartServers

STEPS = 32 * 2  # (2 envs x 32 steps an update)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CartPole run (in-process envs, 2 updates, a checkpoint after each): copied by the tests that change it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    options: dict[str, Any] = {"backend": "gym", "num_envs": 2, "num_steps": 32, "checkpoint_seconds": 0.0}
    train(Args(env="CartPole-v1", **options, total_timesteps=2 * STEPS, run_dir=str(run), **QUIET))
    return run


def copy_of(run: Path, tmp_path: Path, name: str = "run") -> Path:
    copied = tmp_path / name
    shutil.copytree(run, copied, ignore=shutil.ignore_patterns(rundir.LOCK))
    return copied


def edit_config(run: Path, **args: Any) -> None:
    config = rundir.read_json(run / rundir.CONFIG)
    config["args"].update(args)
    rundir.write_json(run / rundir.CONFIG, config)


def files_of(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"
    }


# -- servers that make another task -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_resumed_on_servers_of_another_task_is_warned_of(
    finished_run: Path, tmp_path: Path, start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """The same env id and spaces, another time limit (--max-episode-steps 50 on the server, the run's 500):
    the resumed run trains on that task, as learner eval's returns are of it: warned of (at the default level)."""
    run = copy_of(finished_run, tmp_path)
    same = start_servers("CartPole-v1", 1, 2)
    shorter = start_servers("CartPole-v1", 1, 2, server_args=["--max-episode-steps", "50"])
    with caplog.at_level(logging.WARNING, logger="learner"):
        train(resume_args(run, servers=same[0], backend="remote", total_timesteps=3 * STEPS))
        assert "make their envs otherwise" not in caplog.text, caplog.text  # (the run's task: nothing to say)
        train(resume_args(run, servers=shorter[0], backend="remote", total_timesteps=4 * STEPS))
    (record,) = [r for r in caplog.records if "make their envs otherwise" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.name == "learner.train"
    assert f"the servers at {shorter[0]}" in record.getMessage()
    assert "time limit 50 (the run's: 500)" in record.getMessage()
    # From here on the run's checkpoints record the task it trains on.
    assert torch.load(rundir.list_checkpoints(run)[-1], weights_only=False)["served"]["max_episode_steps"] == 50


# -- a run dir whose step checkpoints went ------------------------------------------------------------------------


def test_a_run_dir_whose_step_checkpoints_went_is_refused_not_started_over(finished_run: Path, tmp_path: Path) -> None:
    """best.pt (or a summary, or metrics rows past the first update) says the run had checkpoints: without its
    step-*.pt it has nothing to go on from, but it did not stop before its first checkpoint either, so it is
    not started over (its files set aside) under that false reason: refused, naming what is there, left as it is."""
    run = copy_of(finished_run, tmp_path)
    last = rundir.list_checkpoints(run)[-1]
    shutil.copy(last, run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT)
    for path in rundir.list_checkpoints(run):
        path.unlink()
    fresh = Args(env="CartPole-v1", backend="gym", num_envs=2, num_steps=32, total_timesteps=STEPS, run_dir=str(run))
    for shown, remove in (
        ("checkpoints/best.pt", rundir.CHECKPOINTS + "/" + rundir.BEST_CHECKPOINT),
        (f"summary.json (of a run that ended at step {2 * STEPS})", rundir.SUMMARY),
        ("metrics.jsonl (rows up to update 2", None),
    ):
        before = files_of(run)
        for again, flag in ((lambda: train(resume_args(run)), "--resume"), (lambda: train(fresh), "--run-dir")):
            with pytest.raises(FileExistsError) as refused:
                again()
            assert str(refused.value).startswith(f"{flag} {run}"), refused.value
            assert shown in str(refused.value) and "to start the run over, move its files out" in str(refused.value)
            assert files_of(run) == before and not (run / "previous").exists()
        if shown.startswith("checkpoints/best.pt"):
            assert f"learner eval {run}/checkpoints/best.pt" in str(refused.value)
        if remove:
            (run / remove).unlink()


def test_a_run_stopped_before_its_first_checkpoint_is_set_aside_as_it_was_laid_out(
    finished_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed in its first update, in its first checkpoint's write: it starts over, its files in previous/, the
    checkpoints/ folder's in previous/checkpoints/ (they went flat into previous/, beside the run's own files)."""
    run = copy_of(finished_run, tmp_path)
    shutil.rmtree(run / rundir.CHECKPOINTS)
    (run / rundir.SUMMARY).unlink()
    rows = rundir.read_jsonl(run / rundir.METRICS)[:1]  # (its first update's row, written just before the checkpoint)
    rundir.rewrite_jsonl(run / rundir.METRICS, rows)
    (run / rundir.CHECKPOINTS).mkdir()
    (run / rundir.CHECKPOINTS / ".step-0000000064.pt.0123456789ab.tmp").write_bytes(b"half a checkpoint")
    with caplog.at_level(logging.WARNING, logger="learner"):
        summary = train(resume_args(run))
    assert summary["total_steps"] == 2 * STEPS
    assert "and this run starts over" in caplog.text
    aside = run / "previous"
    assert rundir.read_jsonl(aside / rundir.METRICS) == rows
    assert (aside / rundir.CHECKPOINTS / ".step-0000000064.pt.0123456789ab.tmp").read_bytes() == b"half a checkpoint"
    assert not list(aside.glob("*.tmp"))


def test_a_run_whose_first_checkpoint_could_not_be_written_starts_over(finished_run: Path, tmp_path: Path) -> None:
    """A full disk at the first checkpoint: the run ends in an error, its summary.json written (an update in it),
    no checkpoint. Once there is room, --resume starts it over: its summary is no sign of a checkpoint that went
    (it was refused as a run whose checkpoints were deleted)."""
    run = copy_of(finished_run, tmp_path)
    shutil.rmtree(run / rundir.CHECKPOINTS)
    rundir.rewrite_jsonl(run / rundir.METRICS, rundir.read_jsonl(run / rundir.METRICS)[:1])
    summary = rundir.read_json(run / rundir.SUMMARY)
    error = "error: RunDirWriteError: cannot write checkpoints/step-0000000064.pt: No space left on device"
    rundir.write_json(run / rundir.SUMMARY, {**summary, "stop_reason": error, "updates": 1, "total_steps": STEPS})
    assert train(resume_args(run))["total_steps"] == 2 * STEPS
    assert (run / "previous" / rundir.SUMMARY).is_file()


# -- the rows past the checkpoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("past", [False, True])
def test_resume_cuts_off_the_rows_past_its_checkpoint_and_leaves_a_file_with_none_as_it_was(
    finished_run: Path, tmp_path: Path, past: bool
) -> None:
    """A long run's metrics.jsonl (2 KB a row: 215 MB after 2 h of CartPole) is neither read whole nor written
    again on --resume: the rows past the checkpoint (a killed run's), and a last line cut short, are cut off its
    end, the rows before them left as they were; a file with none past is not written at all (its inode and
    modification time as they were)."""
    run = copy_of(finished_run, tmp_path)
    metrics = run / rundir.METRICS
    kept = metrics.read_bytes()
    if past:
        last = rundir.read_jsonl(metrics)[-1]
        with open(metrics, "a") as f:
            for update in (3, 4):
                f.write(json.dumps({**last, "update": update, "global_step": update * STEPS}) + "\n")
            f.write('{"update": 5, "global_st')  # (cut short by the kill)
    before = metrics.stat()
    on_start: dict[str, Any] = {}

    def started(config: dict[str, Any]) -> None:  # (restored, before this session's first row)
        on_start.update(text=metrics.read_bytes(), stat=metrics.stat())

    train(resume_args(run, total_timesteps=3 * STEPS), on_start=started)
    assert on_start["text"] == kept
    assert on_start["stat"].st_ino == before.st_ino
    if not past:
        assert on_start["stat"].st_mtime_ns == before.st_mtime_ns
    assert [r["update"] for r in rundir.read_jsonl(metrics)] == [1, 2, 3]


def test_the_rows_past_an_update_are_cut_off_a_metrics_file_read_from_its_end(tmp_path: Path) -> None:
    """rundir.drop_rows_after, read a few bytes at a time: a row kept that lost its line's end gets one (the next
    row would continue its line), a row without an update (an older version's) is kept, and lines that are no
    row among those past go with them."""
    metrics = tmp_path / rundir.METRICS
    rows = [json.dumps({"update": u, "x": "y" * u}) + "\n" for u in range(1, 6)]
    for text, update, left, dropped in (
        ("".join(rows), 5, "".join(rows), 0),
        ("".join(rows), 3, "".join(rows[:3]), 2),
        ("".join(rows), 0, "", 5),
        ("".join(rows)[:-1], 5, "".join(rows), 0),
        ("".join(rows[:3]) + "no row\n\n" + rows[4] + "[4]\n" + '{"upd', 3, "".join(rows[:3]), 4),
        ('{"seconds": 1}\n' + rows[3], 2, '{"seconds": 1}\n', 1),
        ("", 1, "", 0),
    ):
        metrics.write_text(text)
        assert rundir.drop_rows_after(metrics, update, block=7) == dropped, (text, update)
        assert metrics.read_text() == left, (text, update)


def test_a_metrics_file_s_last_row_is_written_again_in_place(tmp_path: Path) -> None:
    """rundir.rewrite_last_row (learner train's final evaluation of a solved run, Recorder.add_evaluation): the last
    row, of the row's update, written again with the columns added, read a few bytes at a time: the rows before it
    byte for byte as they were, the file's inode the same; a file whose last row is another update's (or a last line
    cut short) gets it appended, on a line of its own."""
    metrics = tmp_path / rundir.METRICS
    rows = [{"update": u, "x": "y" * u} for u in range(1, 4)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    new = {**rows[-1], "eval/return_mean": 9.5}
    for before, row, after in (
        (text, new, text.rsplit("{", 1)[0] + json.dumps(new) + "\n"),
        (text + "\n", new, text.rsplit("{", 1)[0] + json.dumps(new) + "\n"),  # (a blank line after it goes)
        (text, {"update": 3}, text.rsplit("{", 1)[0] + '{"update": 3}\n'),  # (a shorter row: the file cut after it)
        (text[: text.rindex("{")], new, text.rsplit("{", 1)[0] + json.dumps(new) + "\n"),  # (not there: appended)
        (text[:-4], new, text[:-4] + "\n" + json.dumps(new) + "\n"),  # (its line cut short: another row's after it)
        ("", new, json.dumps(new) + "\n"),
    ):
        metrics.write_text(before)
        inode = metrics.stat().st_ino
        rundir.rewrite_last_row(metrics, row, block=7)
        assert metrics.read_text() == after, before
        assert metrics.stat().st_ino == inode


# -- a damaged config.json ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{}", " (it has no 'args' object)"),
        ('{"args": []}', " (it has no 'args' object)"),
        ("[1, 2]", " (it has no 'args' object)"),
        ("{bad", ": Expecting property name enclosed in double quotes"),
        ('{"args": {}, "ppo": [1]}', " (its 'ppo' is not an object)"),
        ('{"args": {}, "envs": "CartPole-v1"}', " (its 'envs' is not an object)"),
    ],
)
def test_a_damaged_config_json_is_an_error_naming_the_file_and_resume(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / rundir.CONFIG).write_text(text)
    with pytest.raises(ValueError) as refused:
        resume_args(tmp_path)
    assert str(refused.value).startswith(f"--resume: {tmp_path / rundir.CONFIG} is no run's config.json{why}")
    with pytest.raises(ValueError, match=r"^--like: .* is no run's config\.json"):  # (the same reading)
        like_args(tmp_path)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"num_steps": "abc"}, "--num-steps: expected an integer or null, got 'abc' (str)"),
        ({"learning_rate": [1]}, "--learning-rate: expected a number or null, got [1] (list)"),
        ({"hidden_sizes": [64, "a"]}, "--hidden-sizes: expected a list of integers or null, got [64, 'a'] (list)"),
        ({"backend": "docker"}, "--backend: expected one of 'remote', 'gym', got 'docker' (str)"),
        ({"norm_obs": 2}, "--norm-obs: expected true or false or null, got 2 (int)"),
    ],
)
def test_a_config_json_option_of_the_wrong_type_is_an_error_naming_file_and_option(
    tmp_path: Path, args: dict[str, object], why: str
) -> None:
    """A config.json edited by hand (was: a TypeError traceback from Args' checks); an option given here
    instead of the damaged one mends it."""
    rundir.write_json(tmp_path / rundir.CONFIG, {"args": {"env": "CartPole-v1", **args}})
    name = next(iter(args))
    flag = "--" + name.replace("_", "-")
    for read, option in ((resume_args, "--resume"), (like_args, "--like")):
        with pytest.raises(ValueError) as refused:
            read(tmp_path)
        assert str(refused.value) == (
            f"{option}: {tmp_path / rundir.CONFIG} records {why}; mend it there, or give {flag} here"
        )
    mended = {"num_steps": 8, "learning_rate": 1e-3, "hidden_sizes": (8,), "backend": "gym", "norm_obs": True}
    assert getattr(like_args(tmp_path, **{name: mended[name]}), name) == mended[name]


def test_args_of_the_wrong_type_from_python_are_a_type_error_naming_the_option() -> None:
    with pytest.raises(TypeError, match=r"^--num-steps: expected an integer or null, got '8' \(str\)$"):
        Args(num_steps="8")  # type: ignore[arg-type]
    assert Args(num_steps=np.int64(8), learning_rate=np.float32(1e-3)).num_steps == 8  # type: ignore[arg-type]
    assert Args(run_dir=Path("runs/a")).run_dir == "runs/a"  # type: ignore[arg-type]
    # What stands for a value of the type exactly is taken as that (total_timesteps=1e6 worked before the check).
    taken = Args(total_timesteps=1e6, norm_obs=1, preset=np.str_("classic"))  # type: ignore[arg-type]
    assert (taken.total_timesteps, taken.norm_obs, taken.preset) == (1_000_000, True, "classic")
    assert type(taken.total_timesteps) is int and type(taken.preset) is str


def test_a_config_json_that_recorded_a_whole_float_for_an_integer_option_is_taken(tmp_path: Path) -> None:
    """A run started from Python with total_timesteps=1024.0 recorded the float; its config.json still reads."""
    rundir.write_json(tmp_path / rundir.CONFIG, {"args": {"env": "CartPole-v1", "total_timesteps": 1024.0}})
    assert like_args(tmp_path).total_timesteps == 1024


def test_like_of_a_config_json_that_names_no_env_repeats_the_env_it_records_or_asks_for_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """args.env null (a hand edit, another tool's file): --like trained CartPole-v1, the default, with the
    hyperparameters the run resolved for its own env, silently. The env its envs.env_id records is taken,
    with a warning; without one, an error asking for --env (unless on running servers, which say theirs)."""
    ppo = {"preset": "classic", "gamma": 0.97, "learning_rate": 1e-3}
    rundir.write_json(
        tmp_path / rundir.CONFIG,
        {"args": {"env": None, "gamma": None, "learning_rate": None}, "envs": {"env_id": "Acrobot-v1"}, "ppo": ppo},
    )
    with caplog.at_level(logging.WARNING, logger="learner"):
        args = like_args(tmp_path)
    assert (args.env, args.gamma, args.learning_rate) == ("Acrobot-v1", 0.97, 1e-3)
    assert (
        f'--like: {tmp_path / rundir.CONFIG} names no env in its args ("env": null); the run trained on Acrobot-v1 '
        "(its envs' env_id), which this run trains on too (give --env to pick another)"
    ) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="learner"):
        assert like_args(tmp_path, env="Acrobot-v1").gamma == 0.97  # (the same env named: the run's options)
        assert like_args(tmp_path, env="CartPole-v1").gamma is None  # (another env: its preset's)
    assert "names no env" not in caplog.text
    rundir.write_json(tmp_path / rundir.CONFIG, {"args": {"env": None}, "ppo": ppo})
    with pytest.raises(ValueError) as refused:
        like_args(tmp_path)
    assert str(refused.value) == (
        f'--like: {tmp_path / rundir.CONFIG} names no env (its args\' "env" is null, and it records no envs.env_id), '
        "so the run cannot be repeated on envs this command starts (it would be CartPole-v1, the default, with the "
        "hyperparameters the run resolved for its own env); give --env with the env it trained on"
    )
    assert like_args(tmp_path, env="Pendulum-v1").env == "Pendulum-v1"
    assert like_args(tmp_path, servers="127.0.0.1:1").env is None  # (the servers say what they serve)


@pytest.mark.slow
def test_a_run_resumed_with_env_kwargs_that_change_its_spaces_is_told_they_may_be_why(tmp_path: Path) -> None:
    """ClockEnv(action="box") has Box actions, the run's nets Discrete(2)'s: the error said to resume it with
    the same env kwargs, not which ones these envs got."""
    run = tmp_path / "run"
    options: dict[str, Any] = {"backend": "gym", "num_envs": 2, "num_steps": 8, "checkpoint_seconds": 0.0}
    train(Args(env="tests.envs:ClockEnv", **options, total_timesteps=16, run_dir=str(run), **QUIET))
    with pytest.raises(ValueError) as refused:
        train(resume_args(run, env_kwargs={"action": "box"}, total_timesteps=32))
    assert str(refused.value).startswith(f"--resume: the run in {run} trained its nets on actions Discrete(2), ")
    assert str(refused.value).endswith(
        "; resume it on the same env, wrappers and env kwargs (these envs were made with --env-kwargs "
        '{"action": "box"}, not the run\'s {}, which may be what changed them: leave --env-kwargs out to resume it '
        "with the run's)"
    )


# -- a run moved onto --servers -------------------------------------------------------------------------------------


def test_a_run_moved_onto_servers_leaves_its_backend_and_transport(finished_run: Path, tmp_path: Path) -> None:
    """--backend gym and --transport were the run's way to its envs, not the servers': the move onto --servers
    takes the remote backend and the default transport, unless given here (then refused as they conflict)."""
    run = copy_of(finished_run, tmp_path)
    moved = resume_args(run, servers="127.0.0.1:1")  # (the run's: --backend gym)
    assert (moved.servers, moved.backend, moved.transport) == ("127.0.0.1:1", "remote", DEFAULT_TRANSPORT)
    assert like_args(run, servers="127.0.0.1:1").backend == "remote"
    with pytest.raises(
        ValueError, match=r"^--servers: trains on running env servers, so it cannot go with --backend gym"
    ):
        resume_args(run, servers="127.0.0.1:1", backend="gym")
    other = "tcp" if DEFAULT_TRANSPORT == "unix" else "unix"
    edit_config(run, backend="remote", transport=other)  # (a run on local servers over the other transport)
    moved = resume_args(run, servers="127.0.0.1:1")
    assert (moved.backend, moved.transport) == ("remote", DEFAULT_TRANSPORT)
    with pytest.raises(ValueError, match=r"^--transport: says how to reach the env servers this command starts"):
        resume_args(run, servers="127.0.0.1:1", transport=other)


# -- a run of an older version: what it recorded for options that did not apply -----------------------------------

OLD_TRANSPORT = "tcp" if DEFAULT_TRANSPORT == "unix" else "unix"
"""What versions before the step socket recorded as every run's --transport (tcp, then the default)."""


def test_an_older_gym_run_recorded_transport_and_step_socket_that_did_not_apply_and_is_resumed(
    finished_run: Path, tmp_path: Path
) -> None:
    """Before unix became the default every run recorded "transport": "tcp", and a few versions took
    --no-step-socket with --backend gym (ignored there): both were refused as if given ("--transport: says how to
    reach env servers, so it cannot go with --backend gym"), with no way out but --transport unix. They did not
    apply to the run's in-process envs: taken as not given. Given here, they are refused as a new run's."""
    run = copy_of(finished_run, tmp_path)
    edit_config(run, transport=OLD_TRANSPORT)
    for args in (resume_args(run), like_args(run, run_dir=str(tmp_path / "like"))):
        assert (args.backend, args.transport) == ("gym", DEFAULT_TRANSPORT)
    edit_config(run, step_socket=False, pipeline_groups=2)  # (nor did these, hand-edited or not)
    for args in (resume_args(run), like_args(run, run_dir=str(tmp_path / "like"))):
        assert (args.transport, args.step_socket, args.pipeline_groups) == (DEFAULT_TRANSPORT, True, 1)
    # Moved onto envs this command starts, the run reaches them this version's way, not as it recorded.
    assert resume_args(run, backend="remote").transport == DEFAULT_TRANSPORT
    for given, flag in (({"transport": OLD_TRANSPORT}, "--transport"), ({"step_socket": False}, "--no-step-socket")):
        for read in (resume_args, like_args):
            with pytest.raises(ValueError, match=rf"^{flag}: says how to reach env servers, so it cannot go with --b"):
                read(run, **given)
    assert train(resume_args(run, total_timesteps=3 * STEPS))["total_steps"] == 3 * STEPS


def servers_run(run: Path, address: str, **args: Any) -> None:
    """``run`` (the gym run's copy) as a run trained on ``address`` records itself (``args``: as an older version
    recorded it besides)."""
    edit_config(run, **{"servers": address, "backend": "remote", "num_envs": None, **args})


def test_an_older_servers_run_recorded_options_that_did_not_apply_and_is_resumed_or_repeated(
    finished_run: Path, tmp_path: Path
) -> None:
    """A run on --servers recorded --transport tcp (before unix became the default), and the first versions took
    --num-envs, --wrappers, --env-kwargs, ... with --servers and ignored them: refused as if given, blaming them
    on the --servers the config.json records ("give --backend, ..." to move off them). The running servers
    decided them: taken as not given, on the servers and moved off them (which takes the servers' own)."""
    run = copy_of(finished_run, tmp_path)
    local = {"num_envs": 8, "wrappers": "none", "env_kwargs": {"x": 1}, "step_delay_ms": 1.0, "hang_timeout": 5.0}
    servers_run(run, "127.0.0.1:1", transport=OLD_TRANSPORT, **local)
    for args in (resume_args(run), like_args(run, run_dir=str(tmp_path / "like"))):
        assert (args.servers, args.transport) == ("127.0.0.1:1", DEFAULT_TRANSPORT)
        assert {name: getattr(args, name) for name in local} == {
            "num_envs": None,
            "wrappers": "auto",
            "env_kwargs": {},
            "step_delay_ms": 0.0,
            "hang_timeout": None,
        }
    for backend in ("remote", "gym"):  # (gym: refused as the recorded --transport's conflict with it)
        moved = resume_args(run, backend=backend)
        assert (moved.servers, moved.backend, moved.transport, moved.num_envs) == (None, backend, DEFAULT_TRANSPORT, 2)
        assert (moved.wrappers, moved.env_kwargs, moved.step_delay_ms) == ("none", {}, 0.0)  # (the servers' envs)
    with pytest.raises(ValueError) as refused:  # (given here: checked as a new run's)
        resume_args(run, transport=OLD_TRANSPORT)
    assert str(refused.value).startswith("--transport: says how to reach the env servers this command starts;")
    assert "(--servers 127.0.0.1:1 comes from the run's config.json;" in str(refused.value)
    with pytest.raises(ValueError, match=r"^--num-envs: configures the env servers this command starts"):
        like_args(run, num_envs=8, servers="127.0.0.1:2")


@pytest.mark.slow
def test_an_older_servers_run_that_recorded_transport_tcp_goes_on_on_its_servers(
    finished_run: Path, tmp_path: Path, start_servers: StartServers
) -> None:
    """End to end, as `learner train --resume` and `--like` of such a run exited 2 blaming --transport."""
    run = copy_of(finished_run, tmp_path)
    (address,) = start_servers("CartPole-v1", 1, 2, transport="tcp")
    servers_run(run, address, transport=OLD_TRANSPORT)
    assert train(resume_args(run, total_timesteps=3 * STEPS))["total_steps"] == 3 * STEPS
    like = tmp_path / "like"
    assert train(like_args(run, run_dir=str(like), total_timesteps=STEPS))["total_steps"] == STEPS
    assert rundir.read_json(like / rundir.CONFIG)["args"]["transport"] == DEFAULT_TRANSPORT


# -- options that did not apply to the run's envs ------------------------------------------------------------------


def test_action_bounds_given_to_a_resumed_run_of_discrete_actions_is_ignored_with_a_warning(
    finished_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As a new run's: --action-bounds applies to Box actions; CartPole's nets have none to keep."""
    run = copy_of(finished_run, tmp_path)
    args = resume_args(run, action_bounds="squash", total_timesteps=3 * STEPS)
    with caplog.at_level(logging.WARNING, logger="learner"):
        assert train(args)["total_steps"] == 3 * STEPS
    assert "--action-bounds: applies to Box actions, not Discrete(2); ignored" in caplog.text
    # A run of Box actions keeps its bounds (its nets' Gaussian learned with them).
    box = copy_of(finished_run, tmp_path, "box")
    config = rundir.read_json(box / rundir.CONFIG)
    config["envs"]["action_space"] = "Box(-1.0, 1.0, (1,), float32)"
    rundir.write_json(box / rundir.CONFIG, config)
    with pytest.raises(
        ValueError, match=rf"^--action-bounds: the run in {re.escape(str(box))} was trained with --action-bounds clip;"
    ):
        resume_args(box, action_bounds="squash")


# -- a device the host has not --------------------------------------------------------------------------------------


def test_a_recorded_cuda_device_on_a_host_without_one_says_where_it_came_from(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = copy_of(finished_run, tmp_path)
    edit_config(run, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as refused:
        resume_args(run)
    assert str(refused.value).startswith("--device: cuda was asked for, but torch sees no CUDA device")
    assert str(refused.value).endswith(
        f"(--device cuda comes from the run's config.json; give --device cpu, or auto, to resume the run in {run} on "
        "this host)"
    )
    with pytest.raises(ValueError, match=r"comes from the run's config\.json; give --device cpu, or auto, to repeat"):
        like_args(run)
    assert resume_args(run, device="cpu").device == "cpu"
    assert resume_args(run, device="cuda").device == "cuda"  # (given here: train() refuses it, as a new run's)
    assert json.loads((run / rundir.CONFIG).read_text())["args"]["device"] == "cuda"  # (nothing changed)
