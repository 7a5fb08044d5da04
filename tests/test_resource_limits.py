"""The learner under a host's or a container's limits: few file descriptors (``ulimit -n``), a CPU quota,
no usable temporary folder. It lifts what it may, and says what it cannot lift as what it is."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from learner import rundir
from learner.local import FDS_PER_SERVER

LOW = 64  # (a soft limit on open files well under the hard one, and enough to import the learner)
_SOFT, _HARD = resource.getrlimit(resource.RLIMIT_NOFILE)
needs_higher_hard_limit = pytest.mark.skipif(
    _HARD != resource.RLIM_INFINITY and _HARD <= LOW, reason=f"the hard limit on open files is {_HARD}"
)


def _with_soft_limit(*argv: str, soft: int = LOW) -> subprocess.CompletedProcess[str]:
    """``argv`` run with ``ulimit -Sn soft`` (the hard limit as it is), as from a shell whose soft limit is low."""
    command = ["sh", "-c", 'ulimit -Sn "$0" && exec "$@"', str(soft), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@needs_higher_hard_limit
def test_the_learner_command_raises_its_soft_limit_on_open_files_to_the_hard_one_and_the_library_does_not(
    tmp_path: Path,
) -> None:
    """~5 descriptors per env server: 8 servers ran out at ``ulimit -n 48`` (a shell's soft limit is often
    1024, macOS's 256, with a far higher hard limit); the command lifts it, as many tools do, said at DEBUG."""
    result = _with_soft_limit(sys.executable, "-m", "learner", "plot", "--log-level", "debug", str(tmp_path / "none"))
    assert result.returncode == 1, result.stderr  # (no such run dir: the limit was raised before that)
    target = 10240 if _HARD == resource.RLIM_INFINITY else _HARD  # (macOS's OPEN_MAX where the hard one is unlimited)
    assert f"raised the limit on open files (ulimit -n) from {LOW} to {target}\n" in result.stderr, result.stderr
    # The library leaves its caller's process as it is: importing it, or the cli module, raises nothing.
    code = "import resource, learner, learner.cli; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    imported = _with_soft_limit(sys.executable, "-c", code)
    assert imported.stdout.strip() == str(LOW), imported.stderr


# Runs out of file descriptors for real (a soft limit of LOW, all of them opened), then does what a learner
# does with its run dir: locks it (a new run's first file) and writes its summary.json (train's last one).
_OUT_OF_FDS = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from learner import rundir

    run_dir = Path(sys.argv[1])
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    said = []
    try:
        with rundir.lock(run_dir):
            said.append("locked")
    except ValueError as err:
        said.append(str(err))
    summary = run_dir / rundir.SUMMARY
    try:
        rundir.write_json(summary, {"global_step": 3000})
        said.append("written")
    except OSError as err:  # (as train's end does)
        said.append(str(rundir.cannot_write(summary, err)))
    try:
        with rundir.writing(summary):  # (every other run-dir write)
            rundir.write_json(summary, {"global_step": 3000})
        said.append("written")
    except rundir.RunDirWriteError as err:
        said.append(str(err))
    for fd in held:
        os.close(fd)
    print(json.dumps(said))
    """
)


@needs_higher_hard_limit
def test_running_out_of_file_descriptors_is_said_as_such_not_as_a_full_disk_or_a_read_only_folder(
    tmp_path: Path,
) -> None:
    """Was: "cannot write .../summary.json: Too many open files; 62,994.9 MB free there" (the disk
    blamed) and "run dir ...: cannot write there (Too many open files)"."""
    result = _with_soft_limit(sys.executable, "-c", _OUT_OF_FDS, str(tmp_path))
    assert result.returncode == 0, result.stderr
    lock, summary, written = json.loads(result.stdout)
    words = f"out of file descriptors (ulimit -n is {LOW}; a learner needs about {FDS_PER_SERVER} per env server): "
    assert lock == f"run dir {tmp_path}: {words}raise ulimit -n"
    for said in (summary, written):
        assert said == f"cannot write {tmp_path / rundir.SUMMARY}: {words}raise ulimit -n"


@needs_higher_hard_limit
def test_a_server_probed_while_out_of_file_descriptors_is_not_blamed() -> None:
    """Was: "env server 127.0.0.1:9 not answering yet (127.0.0.1:9: Too many open files)", the probe's words
    in the connect's warning and error, with "is the server running, and is the address right?" after it."""
    code = textwrap.dedent(
        """
        import os
        import learner.connecting
        from learner.discovery import probe
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        said = probe("127.0.0.1:9")
        for fd in held:
            os.close(fd)
        print(said)
        """
    )
    result = _with_soft_limit(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    words = f"out of file descriptors (ulimit -n is {LOW}; a learner needs about {FDS_PER_SERVER} per env server)"
    assert result.stdout.strip() == f"{words}: raise ulimit -n"


def test_the_system_s_open_file_table_full_is_not_said_to_be_lifted_by_ulimit(tmp_path: Path) -> None:
    err = OSError(errno.ENFILE, os.strerror(errno.ENFILE))
    said = str(rundir.cannot_write(tmp_path / rundir.SUMMARY, err))
    assert "out of file descriptors, system-wide" in said and "fs.file-max" in said and "MB free" not in said
    # Any other error is said as it was: a full disk, with the room left there.
    full = str(rundir.cannot_write(tmp_path / rundir.SUMMARY, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert "No space left on device" in full and "MB free there" in full


def test_out_of_file_descriptors_anywhere_in_a_command_ends_it_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where no message of the learner's names it (numpy's lazy import of numpy.ma, from np.percentile in a
    replica's statistics, at ulimit -n 40): one line, not a traceback."""
    import learner.plot
    from learner.cli import main

    def plot_runs(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "/venv/numpy/ma/__init__.py")

    monkeypatch.setattr(learner.plot, "plot_runs", plot_runs)
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("learner plot: error: out of file descriptors (ulimit -n is "), err
    assert err.endswith(
        f"raise ulimit -n ([Errno {errno.EMFILE}] {os.strerror(errno.EMFILE)}: '/venv/numpy/ma/__init__.py')\n"
    )


def test_eval_json_out_of_file_descriptors_prints_its_one_object(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import learner.cli
    from learner.cli import main

    def connection(*args: object) -> None:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(learner.cli, "_connection", connection)
    assert main(["eval", str(tmp_path), "--json"]) == 1
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["exit_status"] == 1 and result["error"].startswith("out of file descriptors (ulimit -n is "), out
    assert err == f"learner eval: error: {result['error']}\n"


@pytest.mark.slow
@pytest.mark.needs_torch
def test_no_usable_temporary_folder_says_how_to_give_one(tmp_path: Path) -> None:
    """A read-only root without a tmpfs: tempfile finds no folder it can write in (its own search, here
    given only one that does not exist, as TMPDIR), and the one-line error says the way out."""
    site = tmp_path / "site"
    site.mkdir()
    nowhere = str(tmp_path / "no-such-folder")
    (site / "sitecustomize.py").write_text(
        f"import tempfile\ntempfile._candidate_tempdir_list = lambda: [{nowhere!r}]\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": nowhere,
    }
    argv = ["--env", "CartPole-v1", "--total-timesteps", "64", "--no-progress", "--no-tensorboard", "--no-plot"]
    result = subprocess.run(
        [sys.executable, "-m", "learner", "train", *argv, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("learner train: error: [Errno 2] No usable temporary directory found in "), line
    assert line.endswith(" (set TMPDIR to a writable directory, or mount a tmpfs on /tmp: docker run --tmpfs /tmp)")


@pytest.mark.needs_torch
def test_torch_s_default_threads_are_capped_at_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CNN's (or a CUDA policy's) torch threads: torch's default, the machine's cores, not a container's
    ``--cpus``; capped at usable_cpus() (here a quota of 1 CPU), where --torch-threads does not say."""
    import torch

    import learner.device
    from learner.device import set_torch_threads

    monkeypatch.setattr(learner.device, "usable_cpus", lambda: 1, raising=False)  # (a 1-CPU quota on a larger host)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        for device in ("cpu", "cuda"):
            torch.set_num_threads(4)
            set_torch_threads(torch.device(device), image=True)
            assert torch.get_num_threads() == 1, device
        torch.set_num_threads(4)
        set_torch_threads(torch.device("cpu"), image=True, threads=3)  # (--torch-threads 3: as given)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "4")  # (the user's own choice: kept)
        torch.set_num_threads(4)
        set_torch_threads(torch.device("cpu"), image=True)
        assert torch.get_num_threads() == 4
        set_torch_threads(torch.device("cpu"), image=False)  # (an MLP on the CPU: one, as before)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.needs_torch
def test_config_json_records_the_usable_cpus_beside_the_machine_s(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import learner.provenance
    from learner.provenance import machine_info

    monkeypatch.setattr(learner.provenance, "usable_cpus", lambda: 1, raising=False)
    machine = machine_info(torch.device("cpu"))
    assert machine["usable_cpus"] == 1 and machine["cpus"] == os.cpu_count()
