"""RemoteVectorEnv as a drop-in gymnasium VectorEnv: the parts of the API beyond reset and step."""

from __future__ import annotations

import contextlib
import copy
import functools
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

import learner
from env_server.protocol import source_commit
from learner import RemoteVectorEnv
from learner.errors import InvalidArgumentError, RemoteTimeoutError, ServerBusyError, ServerStartError
from learner.local import LocalServers, label_of
from tests.compare import assert_same
from tests.conftest import StartServers
from tests.envs import CameraClockEnv


@pytest.fixture(scope="module")
def cartpole_server() -> Iterator[list[str]]:
    """One server of 2 CartPole envs for the module's ``cartpole`` tests: each takes it over in a session of
    its own (a new RemoteVectorEnv, closed after: its Release answered) and changes nothing a session outlives
    (a server per test cost ~1-2 s apiece on the 2-core machine)."""
    with LocalServers("CartPole-v1", 1, 2) as servers:
        yield servers.addresses


@pytest.fixture
def cartpole(cartpole_server: list[str]) -> Iterator[RemoteVectorEnv]:
    with RemoteVectorEnv(cartpole_server) as envs:
        yield envs


def test_spec_names_the_served_env_and_its_time_limit(cartpole: RemoteVectorEnv) -> None:
    assert cartpole.spec is not None
    local = gym.spec("CartPole-v1")
    assert (cartpole.spec.id, cartpole.spec.max_episode_steps, cartpole.spec.reward_threshold) == (
        local.id,
        local.max_episode_steps,
        local.reward_threshold,
    )
    assert repr(cartpole).startswith("RemoteVectorEnv(CartPole-v1, [")


@pytest.mark.parametrize(("env", "kwargs"), [("tests.envs:ClockEnv", {"length": 100}), ("CartPole-v1", {})])
def test_the_servers_time_limit_truncates_episodes_and_is_in_the_spec(
    start_servers: StartServers, env: str, kwargs: dict[str, int]
) -> None:
    """--max-episode-steps: a TimeLimit around an entry point's env (which has none of its own), or
    over a gymnasium id's registered one (CartPole-v1: 500)."""
    addresses = start_servers(env, envs_per_server=2, env_kwargs=kwargs, server_args=["--max-episode-steps", "3"])
    with RemoteVectorEnv(addresses) as envs:
        assert envs.spec is not None and envs.spec.max_episode_steps == 3
        envs.reset(seed=0)
        truncated = [envs.step(np.zeros(2, dtype=np.int64))[3].tolist() for _ in range(4)]
    assert truncated == [[False, False], [False, False], [True, True], [False, False]]  # (then the reset step)


def test_an_int_seed_seeds_the_vector_envs_own_generator(cartpole: RemoteVectorEnv) -> None:
    cartpole.reset(seed=5)
    first = cartpole.np_random.integers(1 << 30, size=4)
    assert cartpole.np_random_seed == 5
    cartpole.reset(seed=5)
    assert (cartpole.np_random.integers(1 << 30, size=4) == first).all()


@pytest.mark.filterwarnings("ignore:.*calling render method without specifying any render mode")
def test_render_gives_one_none_per_env_as_gymnasium_without_a_render_mode(cartpole: RemoteVectorEnv) -> None:
    local = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    local.reset(seed=0)
    assert cartpole.render_mode is None and cartpole.render() == local.render() == (None, None)
    assert cartpole.metadata["render_fps"] == local.metadata["render_fps"] == 50
    assert isinstance(cartpole.metadata["render_fps"], int)  # as the env's (a float on the wire)
    local.close()


@pytest.mark.filterwarnings("ignore:.*calling render method without specifying any render mode")
def test_what_is_known_here_is_answered_by_name_as_gymnasium_answers_it(cartpole: RemoteVectorEnv) -> None:
    """skrl renders through call("render") every step (its trainers' default), which raised AttributeError; and
    get_attr answers what the SB3 adapter's does: render_mode, the single spaces, the envs' metadata, spec."""
    local = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    local.reset(seed=0)
    assert cartpole.call("render") == local.call("render") == (None, None)
    for name in ("render_mode", "observation_space", "action_space"):
        assert cartpole.get_attr(name) == local.get_attr(name), name
    assert [(s.id, s.max_episode_steps) for s in cartpole.get_attr("spec")] == [("CartPole-v1", 500)] * 2
    ours, theirs = cartpole.get_attr("metadata"), local.get_attr("metadata")
    assert [m["render_fps"] for m in ours] == [m["render_fps"] for m in theirs] and "autoreset_mode" not in ours[0]
    assert ours[0] is not ours[1]  # (each env's own, as there)
    local.close()


def test_methods_by_name_and_copies_are_refused_with_the_reason(cartpole: RemoteVectorEnv) -> None:
    for refused in (
        lambda: cartpole.call("reset"),
        lambda: cartpole.call("render", 1),
        lambda: cartpole.get_attr("gravity"),
    ):
        with pytest.raises(AttributeError, match="a server runs only what its operator chose"):
            refused()
    with pytest.raises(AttributeError, match=r"RemoteVectorEnv has no set_attr\('gravity', \.\.\.\)"):
        cartpole.set_attr("gravity", 1.0)
    for copier in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match=r"cannot pickle or copy RemoteVectorEnv\(CartPole-v1, .*holds sessions"):
            copier(cartpole)
    cartpole.reset(seed=0)
    cartpole.step(np.zeros(2, dtype=np.int64))  # still whole


def test_a_server_this_process_holds_already_says_so(cartpole: RemoteVectorEnv) -> None:
    with pytest.raises(ServerBusyError, match="that learner is this process: close the RemoteVectorEnv"):
        RemoteVectorEnv(cartpole.addresses, connect_timeout=5)


def test_close_all_lets_go_of_an_env_a_kept_traceback_holds(start_servers: StartServers) -> None:
    """A notebook keeps the traceback of a cell that raised, and the env made in it: the servers stay
    claimed with no name left to close them by. learner.close_all() closes it."""
    addresses = start_servers("CartPole-v1", num_servers=1, envs_per_server=1)

    def train() -> None:
        envs = RemoteVectorEnv(addresses)
        envs.reset(seed=0)
        raise RuntimeError("a bug in the training loop")

    try:
        train()
    except RuntimeError as err:
        kept = err  # (as sys.last_value would be)
    with pytest.raises(ServerBusyError, match=r"learner\.close_all\(\) closes every one of this process"):
        RemoteVectorEnv(addresses, connect_timeout=5)
    assert learner.close_all() == 1 and learner.close_all() == 0
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
    assert kept.__traceback__ is not None


def test_reset_takes_the_mask_out_of_the_callers_options_as_gymnasium_does(cartpole: RemoteVectorEnv) -> None:
    """gymnasium's Sync/AsyncVectorEnv pop reset_mask out of the caller's dict, and vector wrappers read the options
    after the env's reset: RecordEpisodeStatistics saw the mask only on the remote env (other statistics, and
    its in-place write zeroed the ``_episode`` array of infos the user already held). A mask refused is kept,
    nothing reset: a list is no mask (as there), which the wrapper took for one after the envs were reset."""
    cartpole.reset(seed=0)
    options = {"reset_mask": np.array([True, False]), "x": 1}
    cartpole.reset(options=options)
    assert options == {"x": 1}
    cartpole.reset_async(options=(options := {"reset_mask": np.array([False, True])}))
    assert options == {}
    cartpole.reset_wait()
    for mask, error in (
        ([True, False], TypeError),  # (the exception types gymnasium's raise)
        (np.array([1, 0]), TypeError),
        (np.array([True, False, True]), ValueError),
    ):
        options = {"reset_mask": mask}
        with pytest.raises(error, match=r"options\['reset_mask'\]: expected a (numpy )?bool array"):
            cartpole.reset(options=options)
        assert options == {"reset_mask": mask}
        with pytest.raises(InvalidArgumentError, match=r"options\['reset_mask'\]"):
            cartpole.reset_async(options=options)
        assert options == {"reset_mask": mask}


def test_episode_statistics_over_partial_resets_are_those_of_a_sync_vector_env(start_servers: StartServers) -> None:
    addresses = start_servers("CartPole-v1", 2, 2, server_args=["--autoreset-mode", "Disabled"])
    envs: dict[str, gym.vector.VectorEnv] = {
        "sync": gym.vector.SyncVectorEnv(
            [lambda: gym.make("CartPole-v1")] * 4, autoreset_mode=gym.vector.AutoresetMode.DISABLED
        ),
        "remote": RemoteVectorEnv(addresses),
    }
    seen: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for name, env in envs.items():
        wrapped = gym.wrappers.vector.RecordEpisodeStatistics(env)
        wrapped.reset(seed=0)
        rng = np.random.default_rng(3)
        seen[name] = []
        held = []
        for t in range(150):
            _, _, terminated, truncated, infos = wrapped.step(rng.integers(0, 2, 4))
            done = terminated | truncated
            if done.any():
                ended = infos["_episode"]
                held.append((ended, ended.copy()))
                seen[name].append((t, np.flatnonzero(ended).tolist(), infos["episode"]["l"][ended].tolist()))
                wrapped.reset(options={"reset_mask": done})
        assert all(np.array_equal(kept, copied) for kept, copied in held), f"{name}: infos held were changed"
        wrapped.close()
    assert len(seen["sync"]) > 3 and seen["remote"] == seen["sync"]


def test_a_server_of_an_env_it_cannot_carry_fails_to_start_in_one_line() -> None:
    with pytest.raises(ServerStartError) as info:
        LocalServers("tests.envs:TextObservationEnv", 1, 1)
    message = str(info.value)
    assert message.endswith(
        "env-server: error: cannot serve env 'tests.envs:TextObservationEnv': observation_space: "
        f"{gym.spaces.Text(5)} (Text) is not supported; envfleet carries Discrete, Box, MultiDiscrete, "
        "MultiBinary, and Tuple/Dict of these"
    ), message


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            "longdouble",
            "observation_space.dtype: dtype float128 cannot be sent; supported dtypes: bool, float16, float32, "
            "float64, int16, int32, int64, int8, uint16, uint32, uint64, uint8 (the dtype of Box(0.0, 1.0, (2,), "
            "float128))",
        ),
        (
            "int-keys",
            "observation_space: Dict(1: Discrete(2)) (Dict) has the key 1 (int); envfleet carries Dict spaces whose "
            "keys are str",
        ),
    ],
)
def test_a_server_of_a_space_gymnasium_takes_but_the_wire_cannot_carry_fails_to_start_in_one_line(
    kind: str, expected: str
) -> None:
    # (was: a traceback, the codec's CodecError or protobuf's TypeError, where other spaces get one line)
    if kind == "longdouble" and np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("np.longdouble is float64 here, which the wire carries")
    with pytest.raises(ServerStartError) as info:
        LocalServers("tests.envs:UncarriedSpaceEnv", 1, 1, env_kwargs={"kind": kind})
    message = str(info.value)
    assert message.endswith(f"env-server: error: cannot serve env 'tests.envs:UncarriedSpaceEnv': {expected}"), message
    assert "Traceback" not in message, message


@pytest.mark.filterwarnings("ignore:.*precision lowered by casting:UserWarning")  # (gymnasium's own wrappers')
def test_gymnasiums_vector_wrappers_give_what_they_give_on_a_sync_vector_env(start_servers: StartServers) -> None:
    def stack(envs: gym.vector.VectorEnv) -> gym.vector.VectorEnv:
        envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
        envs = gym.wrappers.vector.NormalizeObservation(envs)
        return gym.wrappers.vector.ClipAction(gym.wrappers.vector.RescaleAction(envs, -1.0, 1.0))

    remote = stack(RemoteVectorEnv(start_servers("Pendulum-v1", num_servers=2, envs_per_server=2)))
    local = stack(gym.make_vec("Pendulum-v1", num_envs=4, vectorization_mode="sync"))
    actions = np.random.default_rng(0).uniform(-1.5, 1.5, size=(450, 4, 1)).astype(np.float32)  # some clipped
    try:
        for got, want in zip(remote.reset(seed=3), local.reset(seed=3), strict=True):
            np.testing.assert_equal(got, want)
        episodes = 0
        for action in actions:
            got, want = remote.step(action), local.step(action)
            for a, b in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(a, b)
            assert got[4].keys() == want[4].keys()
            if "episode" in want[4]:
                episodes += 1
                for key in ("r", "l"):
                    np.testing.assert_array_equal(got[4]["episode"][key], want[4]["episode"][key])
                np.testing.assert_array_equal(got[4]["_episode"], want[4]["_episode"])
        assert episodes  # Pendulum's 200-step episodes ended (twice) within the 450 steps
    finally:
        remote.close()
        local.close()


def _without_wall_time(infos: dict[str, object]) -> dict[str, object]:
    """Vector infos less RecordEpisodeStatistics' episode["t"] (wall time, never the same twice)."""
    out = dict(infos)
    if isinstance(out.get("episode"), dict):
        out["episode"] = {key: value for key, value in cast(dict[str, object], out["episode"]).items() if key != "t"}
    return out


@pytest.mark.parametrize(
    "wrappers",
    ["statistics+flatten+normalize", "dict-info-to-list", "transform+filter"],
)
def test_gymnasiums_vector_wrappers_over_dict_observations_give_what_they_give_on_a_sync_vector_env(
    start_servers: StartServers, wrappers: str
) -> None:
    """A robot's Dict observation (tests.envs:CameraClockEnv: uint8 image, float32 state, Discrete, MultiBinary and
    MultiDiscrete keys) through gymnasium's vector wrappers as a training loop of one's own stacks them: episode
    statistics, FlattenObservation then NormalizeObservation (gymnasium's NormalizeObservation takes no Dict: on a
    SyncVectorEnv it fails alike, so a Dict is flattened first), DictInfoToList, TransformObservation of one key,
    FilterObservation. The same as on a SyncVectorEnv of the same envs and actions, episode ends included."""
    vw = gym.wrappers.vector

    def stack(envs: gym.vector.VectorEnv) -> gym.vector.VectorEnv:
        if wrappers == "statistics+flatten+normalize":
            return vw.NormalizeObservation(vw.FlattenObservation(vw.RecordEpisodeStatistics(envs)))
        if wrappers == "dict-info-to-list":
            return vw.DictInfoToList(vw.RecordEpisodeStatistics(envs))
        darker = vw.TransformObservation(envs, lambda obs: {**obs, "image": obs["image"] // 2})
        return vw.FilterObservation(darker, ["image", "state", "gear"])

    kwargs: dict[str, Any] = {"length": 4, "multi": True}
    remote = stack(RemoteVectorEnv(start_servers("tests.envs:CameraClockEnv", 2, 2, env_kwargs=kwargs)))
    local = stack(gym.vector.SyncVectorEnv([functools.partial(CameraClockEnv, **kwargs)] * 4))
    try:
        assert remote.observation_space == local.observation_space
        for got, want in zip(remote.reset(seed=3), local.reset(seed=3), strict=True):
            assert_same(got, want, "reset")
        rng = np.random.default_rng(0)
        ended = 0
        for t in range(10):
            actions = rng.integers(0, 2, size=4)
            got, want = remote.step(actions), local.step(actions)
            assert_same(got[:4], want[:4], f"step {t}")
            if isinstance(want[4], list):
                assert_same(
                    [_without_wall_time(i) for i in got[4]], [_without_wall_time(i) for i in want[4]], f"step {t}"
                )
            else:
                assert_same(_without_wall_time(got[4]), _without_wall_time(want[4]), f"step {t} infos")
            ended += int(np.sum(want[2] | want[3]))
        assert ended == 8  # (every env's episode ended twice)
    finally:
        remote.close()
        local.close()


def test_a_server_another_process_holds_is_not_blamed_on_this_one(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        # Same client name as the holder's, and the server is not this process's.
        with pytest.raises(ServerBusyError) as info:
            RemoteVectorEnv([address], client_name="trainer", connect_timeout=5)
        assert "claimed by 'trainer'" in str(info.value) and "this process" not in str(info.value)
    finally:
        holder.communicate("", timeout=30)


HOLD = """
import sys
from learner import RemoteVectorEnv
with RemoteVectorEnv([sys.argv[1]], client_name="trainer"):
    print("holding", flush=True)
    sys.stdin.read()
"""


def test_arguments_of_the_wrong_kind_are_named(cartpole: RemoteVectorEnv) -> None:
    """Each refused with the argument, what it must be and what came (not "'int' object is not
    iterable", nor taken for something else: True as group 1, 0 or [] as no options)."""
    for options in (5, "ab", [("a", 1)], 0, "", []):
        with pytest.raises(ValueError, match=r"^options: expected a dict \(or None\), got "):
            cartpole.reset(options=options)  # type: ignore[arg-type]
    cartpole.reset(seed=0, options={})
    with pytest.raises(
        ValueError, match=r"^actions: expected an array for Discrete\(2\) \(one action per env\), got None$"
    ):
        cartpole.step(None)
    with pytest.raises(ValueError, match=r"^actions: expected an array for .*, got a str \('left'\)$"):
        cartpole.step("left")
    with pytest.raises(ValueError, match=r"^send: group must be an int in \[0, 1\), got True$"):
        cartpole.send(np.zeros(2, dtype=np.int64), True)
    cartpole.step(np.zeros(2, dtype=np.int64))  # (nothing was sent)
    with pytest.raises(ValueError, match=r"num_groups: expected at most one group per server \(1 server\), got 2"):
        RemoteVectorEnv(cartpole.addresses, num_groups=2)


def test_options_reach_the_envs_as_a_local_vector_env_gives_them(start_servers: StartServers) -> None:
    """``options={}`` reached the envs as None (an env reading ``options.get`` failed remotely only);
    none, ``{}``, some and a reset_mask's as gymnasium's SyncVectorEnv passes them."""
    from tests.envs import OptionsProbeEnv

    reference = gym.vector.SyncVectorEnv([OptionsProbeEnv] * 2)
    with RemoteVectorEnv(start_servers("tests.envs:OptionsProbeEnv", 1, 2)) as envs:
        assert envs.autoreset_mode is reference.autoreset_mode  # (also an attribute, as gymnasium's)
        for options in (None, {}, {"level": 3}, {"reset_mask": np.array([True, False])}):
            got, want = envs.reset(seed=0, options=options)[1], reference.reset(seed=0, options=options)[1]
            assert got["options"].tolist() == want["options"].tolist(), options
    reference.close()


@contextlib.contextmanager
def _ours_and_a_patched_server(tmp_path: Path, env: str, patch: str) -> Iterator[tuple[str, str]]:
    """(the address of a local server of ``env``, that of an env-server of it whose process first runs
    ``patch``, Python lines: another version, another commit)."""
    script = tmp_path / "patched_server.py"
    script.write_text(f"import sys\n{patch}\nfrom env_server.__main__ import main\nsys.exit(main())\n")
    with (
        LocalServers(env, 1, 1) as ours,
        subprocess.Popen(
            [sys.executable, str(script), "--env", env, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        ) as theirs,
    ):
        try:
            assert theirs.stdout is not None
            yield ours.addresses[0], theirs.stdout.readline().strip().removeprefix("listening on ")
        finally:
            theirs.kill()


def test_servers_say_what_they_run_and_a_server_of_another_gymnasium_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """EnvSpec.versions: envfleet, python, gymnasium, numpy and the simulators loaded. Servers of one fleet
    that run another gymnasium (or MuJoCo, ...) may step the same env id otherwise: warned of, by name."""
    pytest.importorskip("mujoco", reason="serves InvertedPendulum-v5: needs MuJoCo (pip install 'envfleet[mujoco]')")
    older = "import gymnasium\ngymnasium.__version__ = '1.0.0'"  # (a server whose gymnasium is another version)
    with _ours_and_a_patched_server(tmp_path, "InvertedPendulum-v5", older) as (ours, address):
        with RemoteVectorEnv([ours, address]) as envs:
            versions = envs.server_versions
            assert versions[ours]["gymnasium"] == gym.__version__
            assert versions[address]["gymnasium"] == "1.0.0" and "mujoco" in versions[address]
            assert {"envfleet", "python", "numpy"} <= set(versions[address])
        assert (
            f"env server {address} runs other versions than env server {label_of(ours)} (gymnasium 1.0.0, not "
            f"{gym.__version__})"
        ) in caplog.text


def test_an_install_from_git_says_its_commit(tmp_path: Path) -> None:
    """``pip install git+URL`` records the commit (PEP 610's direct_url.json); without a .git beside the package
    it is the commit to say (was: none, as for an install from a folder, which records none)."""
    import shutil

    site = tmp_path / "site"
    shutil.copytree(Path(__file__).resolve().parent.parent / "env_server", site / "env_server")
    info = site / "envfleet-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: envfleet\nVersion: 0.1.0\n")
    commit = "c" * 40
    (info / "direct_url.json").write_text(
        f'{{"url": "https://example.org/envfleet.git", "vcs_info": {{"vcs": "git", "commit_id": "{commit}"}}}}'
    )
    said = "from env_server.protocol import runtime_versions; print(runtime_versions().get('envfleet_commit'))"
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    done = run([sys.executable, "-c", said], env={"PYTHONPATH": str(site)})
    assert done.stdout.strip() == commit, done.stderr
    (info / "direct_url.json").write_text('{"url": "file:///tmp/envfleet", "dir_info": {}}')  # (from a folder)
    done = run([sys.executable, "-c", said], env={"PYTHONPATH": str(site)})
    assert done.stdout.strip() == "None", done.stderr


def test_servers_of_other_commits_in_one_fleet_are_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Run from a git checkout, a server says its commit (the version is the same at every commit): a
    half-upgraded fleet is told apart."""
    other = "import env_server.protocol as protocol\nprotocol.source_commit = lambda: 'f' * 40"  # (another checkout's)
    with _ours_and_a_patched_server(tmp_path, "CartPole-v1", other) as (ours, address):
        with RemoteVectorEnv([ours, address]) as envs:
            versions = envs.server_versions
        commit = source_commit()
        assert versions[ours].get("envfleet_commit") == commit and versions[address]["envfleet_commit"] == "f" * 40
        if commit is not None:  # (run from a checkout, as here and in CI; installed, no commit is said)
            assert (
                f"env server {address} runs other versions than env server {label_of(ours)} (envfleet_commit "
                f"{'f' * 40}, not "
                f"{commit})"
            ) in caplog.text


def test_code_written_for_async_vector_envs_async_calls_runs_as_on_one(start_servers: StartServers) -> None:
    """reset_async/reset_wait and step_async/step_wait(timeout): AsyncVectorEnv's signatures, the
    same results, and its pending-call errors."""
    # (a forkserver's processes: this one has gRPC's threads, which a fork must not copy)
    local = gym.vector.AsyncVectorEnv([functools.partial(gym.make, "CartPole-v1")] * 2, context="forkserver")
    with contextlib.closing(local), RemoteVectorEnv(start_servers("CartPole-v1", 1, 2)) as remote:
        for envs in (local, remote):
            with pytest.raises(NoAsyncCallError, match="reset_wait"):
                envs.reset_wait()
        answers = []
        for envs in (local, remote):
            envs.reset_async(seed=7)
            with pytest.raises(AlreadyPendingCallError, match="`reset`"):
                envs.step(np.zeros(2, dtype=np.int64))
            obs, _ = envs.reset_wait(timeout=30)
            envs.step_async(np.ones(2, dtype=np.int64))
            with pytest.raises(AlreadyPendingCallError, match="`step`"):
                envs.reset_async(seed=7)
            answers.append((obs, *envs.step_wait(timeout=30)[:4]))
        for ours, theirs in zip(answers[1], answers[0], strict=True):
            np.testing.assert_array_equal(ours, theirs)
        remote.reset_async(seed=1)
        with pytest.raises(
            AlreadyPendingCallError, match=r"^step: a call to `reset` is still pending; call reset_wait first$"
        ):
            remote.step(np.zeros(2, dtype=np.int64))
        with pytest.raises(InvalidArgumentError, match=r"timeout: expected finite seconds > 0, got -1"):
            remote.reset_wait(timeout=-1)
        remote.reset_wait()  # (a refused timeout leaves the reset pending)


@pytest.mark.parametrize("transport", ["unix", "tcp"])  # (a step socket's step, a gRPC stream's)
@pytest.mark.slow
def test_step_wait_and_reset_wait_give_up_after_their_timeout(start_servers: StartServers, transport: str) -> None:
    addresses = start_servers(
        "tests.envs:SlowResetEnv",
        num_servers=1,
        envs_per_server=1,
        transport=transport,
        server_args=["--step-delay-ms", "3000"],
    )
    with RemoteVectorEnv(addresses, timeout=60) as envs:
        envs.reset(seed=0)  # (its first reset is quick; each one after takes 3 s)
        envs.step_async(np.zeros(1, dtype=np.int64))
        start = time.monotonic()
        with pytest.raises(
            RemoteTimeoutError,
            match=r"Step .*0\.5 s deadline \([^)]*\); the deadline was step_wait's timeout argument: pass a longer",
        ):
            envs.step_wait(timeout=0.5)
        assert time.monotonic() - start < 2.5
        envs.reset_async(seed=0)
        start = time.monotonic()
        with pytest.raises(
            RemoteTimeoutError,
            match=r"Reset .*0\.5 s deadline \(.*\); the deadline was reset_wait's timeout argument: pass a longer",
        ):
            envs.reset_wait(timeout=0.5)
        assert time.monotonic() - start < 2.5


def test_reset_async_takes_seeds_from_an_iterator(start_servers: StartServers) -> None:
    with RemoteVectorEnv(start_servers("CartPole-v1", 1, 2)) as envs:
        # (reset_async reads any iterable of seeds; its annotation says Sequence)
        envs.reset_async(seed=cast(Sequence[int], iter([3, 4])))
        obs, _ = envs.reset_wait()
        np.testing.assert_array_equal(obs, envs.reset(seed=[3, 4])[0])
