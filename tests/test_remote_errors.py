"""RemoteVectorEnv's errors: every one is an EnvFleetError naming what it is about; bad arguments
are refused before anything is sent; servers that cannot be one fleet are told apart in one way."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from env_server import codec
from env_server.rpc import env_pb2 as pb
from learner import (
    AddressError,
    EnvFleetError,
    InvalidArgumentError,
    RemoteVectorEnv,
    ServerUnavailableError,
    SpecMismatchError,
)
from learner.local import label_of
from learner.specs import incompatible
from tests.conftest import SpawnServer, StartServers

NOWHERE = "127.0.0.1:1"  # (nothing listens: an argument refused first never gets there)


def test_no_address_is_an_envfleet_error() -> None:
    with pytest.raises(AddressError, match="addresses: expected at least one server address") as info:
        RemoteVectorEnv([])
    assert isinstance(info.value, EnvFleetError) and isinstance(info.value, ValueError)


def _errors() -> list[BaseException]:
    """One of each error class envfleet raises to its users, with every attribute set."""
    import grpc

    from learner import discovery, errors, remote, train

    made: list[BaseException] = []
    for module in (errors, discovery, remote, train):
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module.__name__):
                continue
            if issubclass(cls, errors.RemoteEnvError):
                made.append(cls("it failed", address="a:1", code=grpc.StatusCode.INTERNAL, env_index=3, details="d"))
            elif cls is errors.TrainingInterrupted:
                made.append(cls({"total_steps": 5}, "runs/x"))
            elif cls is errors.SpecMismatchError:
                made.append(cls("it failed", address="a:1"))
            else:
                made.append(cls("it failed"))
    return made


def test_every_error_of_learner_errors_is_imported_from_learner() -> None:
    import learner
    from learner import errors

    for err in _errors():
        if type(err).__module__ == errors.__name__:
            assert getattr(learner, type(err).__name__) is type(err) and type(err).__name__ in learner.__all__


def _connect_nowhere() -> None:
    RemoteVectorEnv([NOWHERE], connect_timeout=1)


def test_errors_pickle_and_copy_with_their_attributes() -> None:
    """So that a process pool's worker hands them back: pickle remade a RemoteEnvError from its message
    alone, without its keyword-only address (BrokenProcessPool; multiprocessing.Pool's get() hung)."""
    import copy
    import pickle
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    made = _errors()
    assert len(made) > 20
    for err in made:
        for again in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
            assert type(again) is type(err) and str(again) == str(err) and vars(again) == vars(err)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool, pytest.raises(ServerUnavailableError) as info:
        pool.submit(_connect_nowhere).result(timeout=60)
    assert info.value.address == NOWHERE and "nothing answered within 1 s" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": math.inf}, r"^timeout: expected finite seconds > 0, got inf$"),
        ({"timeout": math.nan}, r"^timeout: expected finite seconds > 0, got nan$"),
        ({"timeout": True}, r"^timeout: expected finite seconds > 0, got True$"),
        ({"timeout": "5"}, r"^timeout: expected finite seconds > 0, got '5'$"),
        ({"connect_timeout": math.inf}, r"^connect_timeout: expected finite seconds > 0, got inf$"),
        ({"give_up_after": math.inf}, r"^give_up_after: expected finite seconds > 0, got inf$"),
        ({"backoff": (0.1, math.inf)}, r"^backoff: expected \(first, longest\) finite seconds .*got \(0.1, inf\)$"),
        ({"backoff": 0.1}, r"^backoff: expected \(first, longest\) finite seconds .*got 0.1$"),
        ({"spin_wait": math.nan}, r"^spin_wait: expected seconds in \[0, 1\], got nan$"),
        ({"num_groups": True}, r"^num_groups: expected an int >= 1, got True$"),
        # (bool("off") is True: taken, they did the opposite of what was meant)
        ({"step_socket": "off"}, r"^step_socket: expected True or False, got 'off'$"),
        ({"fault_tolerant": "no"}, r"^fault_tolerant: expected True or False, got 'no'$"),
        ({"copy": 0}, r"^copy: expected True or False, got 0$"),
    ],
)
def test_options_in_seconds_must_be_finite_numbers(kwargs: dict[str, Any], message: str) -> None:
    """``timeout=inf`` passed ``timeout > 0`` and failed at once: "no answer within the inf s deadline"."""
    with pytest.raises(InvalidArgumentError, match=message) as info:
        RemoteVectorEnv([NOWHERE], connect_timeout=kwargs.pop("connect_timeout", 0.5), **kwargs)
    assert isinstance(info.value, ValueError)


def test_addresses_of_any_iterable_are_taken_in_order_and_others_refused_saying_what_to_pass() -> None:
    """A generator was used up by the duplicates check (then "expected at most one group per server (0 server)");
    a set's order, the envs', changed from run to run; an int, bytes or LocalServers object failed in Python."""
    from types import SimpleNamespace

    from learner import InvalidArgumentTypeError, local_servers

    with pytest.raises(ServerUnavailableError, match=f"env server {NOWHERE}: nothing answered"):
        RemoteVectorEnv((a for a in [NOWHERE]), connect_timeout=0.5)  # type: ignore[arg-type]
    wanted = "addresses: expected a list of server addresses or one comma-separated string"
    for given, says in [
        ({NOWHERE}, "got a set, whose order (the envs') is arbitrary"),
        (50051, "got 50051"),
        (None, "got None"),
        (b"localhost:1", "got b'localhost:1'"),
        ([NOWHERE, 1], f"got ['{NOWHERE}', 1]"),
        (SimpleNamespace(addresses=[NOWHERE]), "(a SimpleNamespace: pass its .addresses)"),
        (local_servers("CartPole-v1", 1, 1), "(a context manager: pass what it gives, `with local_servers(...) as"),
    ]:
        with pytest.raises(InvalidArgumentTypeError) as info:
            RemoteVectorEnv(given, connect_timeout=0.5)  # type: ignore[arg-type]
        assert str(info.value).startswith(wanted) and says in str(info.value)


def test_reset_options_that_cannot_be_sent_are_the_callers_error(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", envs_per_server=2)
    with RemoteVectorEnv([address]) as envs:
        with pytest.raises(InvalidArgumentError, match=r"^options\['x'\]: ") as info:
            envs.reset(options={"x": object()})
        assert isinstance(info.value, EnvFleetError) and isinstance(info.value, ValueError)
        envs.reset(seed=0)  # nothing was sent: the fleet goes on
        envs.step(np.zeros(2, dtype=np.int64))
        with pytest.raises(InvalidArgumentError, match=r"^wait: expected finite seconds >= 0, got inf$"):
            envs.refresh(wait=math.inf)


def test_placeholder_observations_are_in_the_space(spawn_server: SpawnServer) -> None:
    """Envs whose server is down when the fleet is reset have placeholder observations: members of
    the space (were zeros: outside Discrete(3, start=5), and an agent's one-hot of obs - start failed)."""
    a = spawn_server("tests.envs:OffsetSpacesEnv", 2)
    b = spawn_server("tests.envs:OffsetSpacesEnv", 2)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, timeout=2.0, backoff=(0.05, 0.5)) as envs:
        b.kill()
        obs, infos = envs.reset(seed=0)
        assert infos["_env_unavailable"].tolist() == [False, False, True, True]
        space = envs.single_observation_space
        for single in gym.vector.utils.iterate(envs.observation_space, obs):
            assert space.contains(single), single
        assert obs["cell"][2:].tolist() == [5, 5]
        assert obs["grid"][2:].tolist() == [[1, -4], [1, -4]]
        assert obs["level"][2:].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def _spec(
    env_id: str, space: gym.Space[Any], num_envs: int = 2, mode: pb.AutoresetMode = pb.AUTORESET_MODE_NEXT_STEP
) -> pb.EnvSpec:
    return pb.EnvSpec(
        env_id=env_id,
        num_envs=num_envs,
        observation_space=codec.encode_space(space),
        action_space=codec.encode_space(gym.spaces.Discrete(2)),
        autoreset_mode=mode,
    )


def test_one_check_says_what_keeps_servers_out_of_one_fleet() -> None:
    """Made, joining or coming back, a server's spec is checked by one function, which names the field
    and both values (was three checks, with three messages)."""
    four = _spec("A-v0", gym.spaces.Box(-1.0, 1.0, (4,), np.float32))
    six = _spec("B-v0", gym.spaces.Box(-1.0, 1.0, (6,), np.float32))
    assert incompatible(four, four) == ""
    assert incompatible(four, six) == (
        "another observation_space than the fleet's: Box(-1.0, 1.0, (6,), float32) (B-v0), "
        "not Box(-1.0, 1.0, (4,), float32) (A-v0)"
    )
    same_step = _spec("A-v0", gym.spaces.Box(-1.0, 1.0, (4,), np.float32), mode=pb.AUTORESET_MODE_SAME_STEP)
    assert incompatible(four, same_step, whose="env server x:1's") == (
        "another autoreset_mode than env server x:1's: SameStep (A-v0), not NextStep (A-v0)"
    )
    three = _spec("A-v0", gym.spaces.Box(-1.0, 1.0, (4,), np.float32), num_envs=3)
    assert incompatible(four, three) == ""  # (a fleet takes servers of any size ...)
    assert incompatible(four, three, same_size=True) == (  # (... but not in an old place)
        "another num_envs than the fleet's: 3 envs (A-v0), not 2 envs (A-v0)"
    )


def test_servers_whose_env_kwargs_differ_with_their_spaces_are_told_the_kwargs_may_be_why(
    start_servers: StartServers,
) -> None:
    """Servers of one env started with other --env-kwargs (ClockEnv's action="box") have other spaces: the
    check named the spaces alone, as if the servers served another env. Named where both said theirs
    (EnvSpec.env_kwargs), and only for a space (a time limit or an autoreset mode is no kwarg's)."""
    discrete, box = (
        pb.EnvSpec(
            env_id="tests.envs:ClockEnv",
            num_envs=1,
            observation_space=codec.encode_space(gym.spaces.Box(0.0, 1.0, (2,), np.float32)),
            action_space=codec.encode_space(space),
            autoreset_mode=pb.AUTORESET_MODE_NEXT_STEP,
            env_kwargs=kwargs,
        )
        for space, kwargs in (
            (gym.spaces.Discrete(2), ""),
            (gym.spaces.Box(-1.0, 1.0, (1,), np.float32), '{"action": "box"}'),
        )
    )
    assert incompatible(discrete, box, whose="env server a:1's") == (
        "another action_space than env server a:1's: Box(-1.0, 1.0, (1,), float32) (tests.envs:ClockEnv), not "
        'Discrete(2) (tests.envs:ClockEnv) (its envs are made with env kwargs {"action": "box"}, env server a:1\'s '
        "with {}: the env-server --env-kwargs they were started with may be what changed it)"
    )
    unsaid = pb.EnvSpec()
    unsaid.CopyFrom(box)
    unsaid.ClearField("env_kwargs")  # (a server older than the field: nothing to compare)
    assert incompatible(discrete, unsaid).endswith("not Discrete(2) (tests.envs:ClockEnv)")
    same_step = pb.EnvSpec()
    same_step.CopyFrom(discrete)
    same_step.autoreset_mode, same_step.env_kwargs = pb.AUTORESET_MODE_SAME_STEP, '{"length": 5}'
    assert incompatible(discrete, same_step).endswith(
        "SameStep (tests.envs:ClockEnv), not NextStep (tests.envs:ClockEnv)"
    )
    # As a RemoteVectorEnv of such servers says it.
    (plain,) = start_servers("tests.envs:ClockEnv")
    (boxed,) = start_servers("tests.envs:ClockEnv", env_kwargs={"action": "box"})
    with pytest.raises(SpecMismatchError) as refused:
        RemoteVectorEnv([plain, boxed])
    assert refused.value.address == boxed  # (the server that does not fit, for code that acts on it)
    assert (
        f'(its envs are made with env kwargs {{"action": "box"}}, env server {label_of(plain)}\'s with {{}}: '
        in str(refused.value)
    )


def test_servers_of_other_spaces_are_refused_naming_both(start_servers: StartServers) -> None:
    (cartpole,) = start_servers("CartPole-v1")
    (acrobot,) = start_servers("Acrobot-v1")
    with pytest.raises(
        SpecMismatchError,
        match=(
            rf"^env server {re.escape(label_of(acrobot))} has another observation_space than env server "
            rf"{re.escape(label_of(cartpole))}'s: "
            r"Box\(.*\(6,\), float32\) \(Acrobot-v1\), not Box\(.*\(4,\), float32\) \(CartPole-v1\); "
            "one RemoteVectorEnv needs servers whose envs have the same spaces and autoreset mode$"
        ),
    ):
        RemoteVectorEnv([cartpole, acrobot])
    with RemoteVectorEnv([acrobot]) as envs:  # (and let go of)
        assert envs.num_envs == 1


# An env whose int32 Box has no lower bound in its first element and no upper one in its second: made with
# infinities (said on the wire by BoxSpace.unbounded_below/above), or with the dtype's limits, which
# gymnasium prints the same, and which is what a server older than those fields says of the first.
INT_BOX_ENV = """
import gymnasium as gym
import numpy as np

class IntBoxEnv(gym.Env):
    def __init__(self):
        self.observation_space = gym.spaces.Box(np.array([{low}, 0]), np.array([5, {high}]), dtype=np.int32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, dtype=np.int32), {{}}

    def step(self, action):
        return np.zeros(2, dtype=np.int32), 0.0, False, False, {{}}
"""


def test_servers_whose_spaces_print_the_same_but_differ_on_the_wire_are_told_where(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    """Servers of two envfleet versions serving an integer Box with infinite bounds (one says which elements
    have none, one does not) were refused with the same space printed twice: the fields that differ are named."""
    addresses = []
    for name, low, high in (("new", "-np.inf", "np.inf"), ("old", "np.iinfo(np.int32).min", "np.iinfo(np.int32).max")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "intbox.py").write_text(INT_BOX_ENV.format(low=low, high=high))
        pythonpath = os.pathsep.join(filter(None, [str(tmp_path / name), os.environ.get("PYTHONPATH")]))
        addresses.append(spawn_server("intbox:IntBoxEnv", 1, environ={"PYTHONPATH": pythonpath}).address)
    new, old = addresses
    box = "Box([-2147483648           0], [         5 2147483647], (2,), int32) (intbox:IntBoxEnv)"
    with pytest.raises(SpecMismatchError) as refused:
        RemoteVectorEnv([new, old])
    assert str(refused.value) == (
        f"env server {old} has another observation_space than env server {new}'s: {box}, not {box} (the same "
        "as gymnasium prints them, but they differ in observation_space.box.unbounded_below (its: not set; "
        f"env server {new}'s: [true, false] (bool)), observation_space.box.unbounded_above (its: not set; env server "
        f"{new}'s: [false, true] (bool)); servers of different envfleet versions may say one space differently: if "
        "so, run one version on all); one RemoteVectorEnv needs servers whose envs have the same spaces and "
        "autoreset mode"
    )


def test_what_differs_in_spaces_that_print_the_same_is_named_at_any_depth() -> None:
    """Any field of a space's message, however deep: a MultiDiscrete's dtype (gymnasium does not print it) in
    a Dict; a field this learner's proto lacks (a newer server's): that they differ."""
    fleet = _spec("A-v0", gym.spaces.Dict({"a": gym.spaces.Discrete(2), "b": gym.spaces.MultiDiscrete([3, 3])}))
    other = _spec(
        "A-v0", gym.spaces.Dict({"a": gym.spaces.Discrete(2), "b": gym.spaces.MultiDiscrete([3, 3], dtype=np.int32)})
    )
    printed = "Dict('a': Discrete(2), 'b': MultiDiscrete([3 3])) (A-v0)"
    assert incompatible(fleet, other) == (
        f"another observation_space than the fleet's: {printed}, not {printed} (the same as gymnasium prints "
        "them, but they differ in observation_space.dict.spaces[1].multi_discrete.nvec (its: [3, 3] (int32); "
        "the fleet's: [3, 3] (int64)), observation_space.dict.spaces[1].multi_discrete.start (its: [0, 0] "
        "(int32); the fleet's: [0, 0] (int64)); servers of different envfleet versions may say one space "
        "differently: if so, run one version on all)"
    )
    newer = pb.EnvSpec()
    newer.CopyFrom(fleet)
    newer.observation_space.dict.spaces[0].discrete.MergeFromString(
        b"\x48\x01"
    )  # (field 9, the varint 1: a field of a newer envfleet's DiscreteSpace)
    assert incompatible(fleet, newer).endswith(  # (not looked into: differ it does)
        "but they differ on the wire; servers of different envfleet versions may say one space differently: if so, "
        "run one version on all)"
    )
    unbounded = _spec("A-v0", gym.spaces.Box(-np.inf, 5, (30,), np.int32))  # (a large mask: its dtype and shape)
    limits = _spec("A-v0", gym.spaces.Box(np.iinfo(np.int32).min, 5, (30,), np.int32))
    assert "differ in observation_space.box.unbounded_below (its: not set; the fleet's: bool (30,));" in incompatible(
        unbounded, limits
    )
    assert "the same as gymnasium prints them" not in incompatible(  # (only where the texts are the same)
        _spec("A-v0", gym.spaces.Discrete(3)), _spec("A-v0", gym.spaces.Discrete(4))
    )


def test_a_call_while_another_thread_is_in_one_is_refused_and_the_other_goes_on(start_servers: StartServers) -> None:
    """Two threads stepping one env failed as the server's fault ("its answer is not to the request sent", "the
    connection broke") and could leave one blocked; now the second is refused, naming what the first is in."""
    import threading

    from learner import ConcurrentUseError

    [address] = start_servers("CartPole-v1", 1, 2, server_args=["--step-delay-ms", "1000"])
    with RemoteVectorEnv([address]) as envs:
        envs.reset(seed=0)
        stepped: list[Any] = []
        first = threading.Thread(target=lambda: stepped.append(envs.step(np.zeros(2, dtype=np.int64))))
        first.start()
        deadline = time.monotonic() + 30
        while envs._caller is None:  # (the first thread in its step)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(ConcurrentUseError, match=r"^reset: another thread is in this RemoteVectorEnv's step; "):
            envs.reset()
        with pytest.raises(ConcurrentUseError, match=r"^step_async: another thread is in this RemoteVectorEnv's step"):
            envs.step_async(np.zeros(2, dtype=np.int64))
        first.join(30)
        assert len(stepped) == 1 and stepped[0][0].shape == (2, 4)
        envs.step(np.zeros(2, dtype=np.int64))  # (and from this thread, once the other's call is done)


def test_the_one_thread_claim_is_the_outer_call_s_until_it_ends_whatever_interrupts_a_call_within() -> None:
    """A Ctrl-C landing in a call within a call (step_groups' act calling send), as that call waited for the
    claim's lock, released the outer call's claim: its clean-up then ran unclaimed, open to another thread."""
    from learner.validate import one_thread

    class Interrupting:
        """The claim's lock, whose next acquire is interrupted when ``interrupt`` is set."""

        def __init__(self) -> None:
            self.lock, self.interrupt = threading.Lock(), False

        def __enter__(self) -> None:
            if self.interrupt:
                self.interrupt = False
                raise KeyboardInterrupt
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    class Env:
        def __init__(self) -> None:
            self._caller_lock, self._caller, self._caller_call = Interrupting(), None, ""
            self.claimed_in_clean_up: list[bool] = []

        @one_thread
        def step_groups(self, act: Any) -> None:
            try:
                act()
            except BaseException:
                self.claimed_in_clean_up.append(self._caller == threading.get_ident())
                raise

        @one_thread
        def send(self) -> None:
            pass

    env = Env()

    def act() -> None:
        env._caller_lock.interrupt = True
        env.send()

    with pytest.raises(KeyboardInterrupt):
        env.step_groups(act)
    assert env.claimed_in_clean_up == [True] and env._caller is None
