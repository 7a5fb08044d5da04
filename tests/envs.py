"""Small envs for the tests, served by entry point (``tests.envs:DictEnv``, ``tests.envs:FaultyEnv``, ...)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, ClassVar, cast

import gymnasium as gym
import numpy as np

from learner.benchmarks.envs import IndexEnv

__all__ = [
    "CameraClockEnv",
    "ClockEnv",
    "DictEnv",
    "FaultyEnv",
    "FuzzEnv",
    "GateEnv",
    "IndexEnv",
    "ResetGateEnv",
    "SlowToBuildEnv",
]


class DictEnv(gym.Env[dict[str, Any], np.ndarray]):
    """Dict observations of several dtypes, Box actions, and infos of every kind the wire carries.

    Episodes end by termination or by truncation at random lengths, so long runs cross many
    episode boundaries; info keys come and go between steps and envs.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": [], "render_fps": 10}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(self, max_len: int = 25) -> None:
        self.max_len = max_len
        self.observation_space = gym.spaces.Dict(
            {
                "position": gym.spaces.Box(-10.0, 10.0, shape=(3,), dtype=np.float64),
                "camera": gym.spaces.Box(0, 255, shape=(2, 4, 4), dtype=np.uint8),
                "mode": gym.spaces.Discrete(5, start=-2),
                "flags": gym.spaces.MultiBinary(4),
                "nested": gym.spaces.Dict(
                    {
                        "grid": gym.spaces.MultiDiscrete([3, 4]),
                        "pair": gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, (2,), np.float32))),
                    }
                ),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self._t = 0
        self._pos = np.zeros(3)
        self._limit = max_len

    def _obs(self) -> dict[str, Any]:
        rng = self.np_random
        return {
            "position": self._pos.copy(),
            "camera": rng.integers(0, 256, size=(2, 4, 4), dtype=np.uint8),
            "mode": np.int64(rng.integers(-2, 3)),
            "flags": rng.integers(0, 2, size=4, dtype=np.int8),
            "nested": {
                "grid": rng.integers(0, [3, 4]).astype(np.int64),
                "pair": (np.int64(rng.integers(0, 3)), rng.uniform(-1, 1, 2).astype(np.float32)),
            },
        }

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"t": self._t, "speed": float(np.linalg.norm(self._pos)), "ok": bool(self._t % 2)}
        if self._t % 3 == 0:
            info["label"] = f"step-{self._t}"
        if self._t % 4 == 1:
            info["vec"] = np.arange(3, dtype=np.float32) * self._t
        if self._t % 5 == 2:
            info["stats"] = {"count": self._t, "ratio": self._t / 7, "name": "x"}
        return info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        self._pos = self.np_random.uniform(-1, 1, 3)
        self._limit = int(self.np_random.integers(5, self.max_len + 1))
        info = self._info()
        if options:
            info["options_seen"] = sorted(options)
            info["options_count"] = len(options)
        return self._obs(), info

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        self._t += 1
        self._pos = np.clip(self._pos + np.concatenate([action, [0.1]]).astype(np.float64), -10, 10)
        terminated = bool(self.np_random.random() < 0.05)
        truncated = not terminated and self._t >= self._limit
        reward = float(-np.abs(self._pos).sum())
        return self._obs(), reward, terminated, truncated, self._info()


class ClockEnv(gym.Env[np.ndarray, Any]):
    """Fully deterministic: every episode starts the same and lasts exactly ``length`` steps.

    The observation is the time, ``[t / length, 1 - t / length]``; the reward is 1 for the action
    that matches the time's parity (Discrete(2)), or ``-|a - target|`` with a time-dependent target
    (Box). Episodes end by truncation (or by termination with ``end="terminate"``), so with
    next-step autoreset each one occupies ``length + 1`` vector steps: a rollout of a multiple of
    that many steps ends with every env back at an episode's start, as after a fresh reset.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 10}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(
        self,
        length: int = 3,
        action: str = "discrete",
        end: str = "truncate",
        render_mode: str | None = None,
        still: bool = False,
    ) -> None:
        self.length = length
        self.end = end
        self.render_mode = render_mode
        self.still = still  # render the same frame at every step
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space: gym.Space[Any] = {
            "discrete": gym.spaces.Discrete(2),
            "box": gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32),
            "tuple": gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),  # (no policy takes it)
        }[action]
        self._t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._t / self.length, 1 - self._t / self.length], dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {}

    def render(self) -> np.ndarray | None:
        """rgb_array: a 6x8 frame, as bright as the time is late (frame t of an episode has value 50 t;
        ``still``: 0 always)."""
        if self.render_mode != "rgb_array":
            return None
        return np.full((6, 8, 3), 0 if self.still else min(50 * self._t, 255), dtype=np.uint8)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if isinstance(self.action_space, gym.spaces.Discrete):
            reward = float(int(action) == self._t % 2)
        else:
            reward = -abs(float(np.asarray(action).reshape(-1)[0]) - (0.5 if self._t % 2 else -0.5))
        self._t += 1
        over = self._t >= self.length
        return self._obs(), reward, over and self.end == "terminate", over and self.end == "truncate", {}


class CameraClockEnv(ClockEnv):
    """ClockEnv (as deterministic, its episodes as long, truncated or terminated, its actions and rewards) seen as a
    robot's Dict observation: ``image``, a uint8 camera frame (36, 36, 1), channel-last, as bright as the time is
    late (50 t); ``state``, ClockEnv's float32 vector; ``phase``, the time's parity as a Discrete(2, start=1).
    ``nan_at``: from that step of each episode on, ``state`` holds a NaN (an observation no policy can act on).
    ``multi``: two keys more, ``buttons``, a MultiBinary(2) (the time's parity and whether it is 0), and ``gear``,
    a MultiDiscrete([3, 4], start=[1, 0]) (1 + t % 3, t % 4)."""

    def __init__(
        self, length: int = 3, action: str = "discrete", end: str = "truncate", nan_at: int = -1, multi: bool = False
    ) -> None:
        super().__init__(length=length, action=action, end=end)
        self.nan_at = nan_at
        self.multi = multi
        spaces: dict[str, gym.Space[Any]] = {
            "image": gym.spaces.Box(0, 255, (36, 36, 1), np.uint8),
            "state": gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32),
            "phase": gym.spaces.Discrete(2, start=1),
        }
        if multi:
            spaces["buttons"] = gym.spaces.MultiBinary(2)
            spaces["gear"] = gym.spaces.MultiDiscrete([3, 4], start=[1, 0])
        self.observation_space = gym.spaces.Dict(spaces)  # type: ignore[assignment]

    def _obs(self) -> Any:
        state = super()._obs()
        if 0 <= self.nan_at <= self._t:
            state[0] = np.nan
        image = np.full((36, 36, 1), min(50 * self._t, 255), dtype=np.uint8)
        obs = {"image": image, "state": state, "phase": np.int64(1 + self._t % 2)}
        if self.multi:
            obs["buttons"] = np.array([self._t % 2, self._t == 0], dtype=np.int8)
            obs["gear"] = np.array([1 + self._t % 3, self._t % 4], dtype=np.int64)
        return obs


def _wait_at_gate(gate: str, hold_s: float) -> None:
    """Create the file ``gate``, and return once the test has removed it (or after ``hold_s``)."""
    with open(gate, "w"):
        pass
    deadline = time.monotonic() + hold_s
    while os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)


class GateEnv(ClockEnv):
    """A ClockEnv whose step number ``at`` (counted over the env's life) waits at a gate the test opens.

    Entering that step it creates the file ``gate``; it returns once the file is gone (or after
    ``hold_s``, should the test never open it). So a test knows a step is in progress, and that it
    stays in progress until the test says, with no guess at how long anything takes. With
    ``close_log`` (a file path), its close appends a line there: "closed during a step" or "closed".
    """

    def __init__(
        self, gate: str, at: int = 1, hold_s: float = 60.0, length: int = 3, close_log: str | None = None
    ) -> None:
        super().__init__(length)
        self.gate, self.at, self.hold_s, self.close_log = gate, at, hold_s, close_log
        self._steps = 0
        self._stepping = False

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        self._stepping = True
        try:
            if self._steps == self.at:
                _wait_at_gate(self.gate, self.hold_s)
            return super().step(action)
        finally:
            self._stepping = False

    def close(self) -> None:
        if self.close_log is not None:
            with open(self.close_log, "a") as log:
                log.write("closed during a step\n" if self._stepping else "closed\n")
        super().close()


class CloseGateEnv(ClockEnv):
    """A ClockEnv whose close waits at a gate the test opens, as :class:`GateEnv`'s step does (a
    simulator saving its state): it creates the file ``gate``, and returns once the file is gone (or
    after ``hold_s``). A server's teardown that the test holds after the server stopped listening."""

    def __init__(self, gate: str, hold_s: float = 60.0) -> None:
        super().__init__()
        self.gate, self.hold_s = gate, hold_s

    def close(self) -> None:
        _wait_at_gate(self.gate, self.hold_s)
        super().close()


class ResetGateEnv(ClockEnv):
    """A ClockEnv whose reset number ``at`` (counted over the env's life) waits at a gate the test
    opens, as :class:`GateEnv`'s step does: it creates the file ``gate``, and returns once the file
    is gone (or after ``hold_s``)."""

    def __init__(self, gate: str, at: int = 1, hold_s: float = 60.0) -> None:
        super().__init__()
        self.gate, self.at, self.hold_s = gate, at, hold_s
        self._resets = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self._resets += 1
        if self._resets == self.at:
            _wait_at_gate(self.gate, self.hold_s)
        return super().reset(seed=seed, options=options)


class FuzzEnv(gym.Env[np.ndarray, dict[str, Any]]):
    """A nested action space (Dict of Box, Discrete, MultiBinary and a Tuple), for fuzzing the server's checks."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Dict(
            {
                "move": gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32),
                "pick": gym.spaces.Discrete(3),
                "flags": gym.spaces.MultiBinary(2),
                "pair": gym.spaces.Tuple((gym.spaces.MultiDiscrete([2, 3]), gym.spaces.Discrete(2, start=-1))),
            }
        )
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action: dict[str, Any]) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.action_space.contains(action), action  # the server's checks let only valid actions through
        self._t += 1
        return np.full(2, 0.5, dtype=np.float32), 1.0, False, self._t >= 50, {}


class FaultyEnv(gym.Env[np.ndarray, np.int64]):
    """CartPole-sized faults on demand: raise in ``step`` or ``reset``, or hang in ``step``.

    ``raise_at``/``hang_at`` count this env's steps over its whole life (1 = its first step), so a
    fault happens once; ``fault_env`` picks which of the server's envs misbehaves (by creation
    order within the server process; -1: all). ``raise_in_reset`` makes every reset after the
    first ``raise_in_reset`` resets raise (-1: never); at step ``bad_reward_at`` the observation is
    ragged, which fails the vector env as a whole (not one env's exception: numpy cannot stack it, and
    no check names it, see env_server.envs.misfit_message; a reward that is no number did once, and is
    that env's own error now, see env_server.isolation); ``wrong_shape_in``
    ("reset" or "step") makes that method's observations 3 long instead of 2 (a layout error of the
    env's own); steps ``raise_from`` to ``raise_until - 1`` of its life raise too. Observations are
    ``[t, episode]``.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)
    _created: ClassVar[int] = 0

    def __init__(
        self,
        raise_at: int = -1,
        hang_at: int = -1,
        hang_s: float = 3600.0,
        raise_in_reset: int = -1,
        fault_env: int = 0,
        length: int = 50,
        bad_reward_at: int = -1,
        wrong_shape_in: str = "",
        raise_from: int = -1,
        raise_until: int = -1,
    ) -> None:
        self.index = FaultyEnv._created
        FaultyEnv._created += 1
        faulty = fault_env in (-1, self.index)
        self.raise_at = raise_at if faulty else -1
        self.hang_at = hang_at if faulty else -1
        self.hang_s = hang_s
        self.raise_in_reset = raise_in_reset if faulty else -1
        self.length = length
        self.bad_reward_at = bad_reward_at if faulty else -1
        self.wrong_shape_in = wrong_shape_in if faulty else ""
        self.raising = range(raise_from, raise_until) if faulty else range(0)
        self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._steps = 0
        self._resets = 0
        self._t = 0

    def _obs(self, method: str = "") -> np.ndarray:
        if method and method == self.wrong_shape_in:
            return np.array([self._t, self._resets, 0], dtype=np.float32)
        return np.array([self._t, self._resets], dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if 0 <= self.raise_in_reset <= self._resets:
            raise RuntimeError(f"reset failed on purpose (env {self.index})")
        self._resets += 1
        self._t = 0
        return self._obs("reset"), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self._steps == self.raise_at or self._steps in self.raising:
            raise ValueError(f"step {self._steps} failed on purpose (env {self.index})")
        if self._steps == self.hang_at:
            time.sleep(self.hang_s)
        self._t += 1
        if self._steps == self.bad_reward_at:  # ragged: the vector env itself fails ("inhomogeneous shape")
            ragged: Any = [[float(self._t)], [float(self._resets), 0.0]]
            return ragged, 1.0, False, self._t >= self.length, {}
        return self._obs("step"), 1.0, False, self._t >= self.length, {}


class UnseededEnv(ClockEnv):
    """A ClockEnv whose episodes start at a time drawn from numpy's global generator, which ``reset(seed=...)``
    does not seed (not ``self.np_random``): a seeded reset does not repeat."""

    def __init__(self) -> None:
        super().__init__(length=1_000_000)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = int(np.random.randint(self.length))  # (unseeded on purpose)
        return self._obs(), {}


class ServedDiffersEnv(ClockEnv):
    """A ClockEnv whose episodes after the first start one step in when served (a server's process: its argv has
    --parent-pid, as the learner starts it; an async worker forked from it too), at the start in-process: a
    difference that only an autoreset (or a reset of the envs that ended) shows."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is None and "--parent-pid" in sys.argv:
            self._t = 1
        return self._obs(), {}


class SlowToBuildEnv(ClockEnv):
    """A ClockEnv whose constructor takes ``build_s`` seconds (a big simulator loading its assets)."""

    def __init__(self, build_s: float = 2.0) -> None:
        time.sleep(build_s)
        super().__init__()


class TextObservationEnv(gym.Env[str, np.int64]):
    """Observations of a space envfleet does not carry (Text): a server must refuse it in one line."""

    observation_space = gym.spaces.Text(5)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return "a", {}

    def step(self, action: np.int64) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "a", 0.0, False, False, {}


class UncarriedSpaceEnv(ClockEnv):
    """A ClockEnv whose observation space the wire cannot carry although gymnasium takes it: ``kind``
    "longdouble", a Box of np.longdouble (float128 on x86-64 Linux); "int-keys", a Dict keyed by ints."""

    def __init__(self, kind: str = "longdouble") -> None:
        super().__init__()
        self.observation_space: gym.Space[Any] = (
            gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.longdouble)
            if kind == "longdouble"
            else gym.spaces.Dict({1: gym.spaces.Discrete(2)})  # type: ignore[dict-item]  # (the point: gymnasium takes it)
        )


class OffsetSpacesEnv(gym.Env[dict[str, Any], np.int64]):
    """Observations from spaces that do not hold zero: a Discrete and a MultiDiscrete with ``start``
    above or below it, a Box whose bounds exclude it (a placeholder of zeros would be outside them)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Dict(
            {
                "cell": gym.spaces.Discrete(3, start=5),
                "grid": gym.spaces.MultiDiscrete([2, 3], start=[1, -4]),
                "level": gym.spaces.Box(1.0, 2.0, shape=(2,), dtype=np.float32),
            }
        )
        self.action_space = gym.spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action: np.int64) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        return self.observation_space.sample(), 1.0, False, False, {}


class _CountEnv(gym.Env[np.ndarray, np.int64]):
    """Observations ``[t]``, Discrete(2) actions, reward 1, endless episodes; step infos from ``info``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.array([0.0], dtype=np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        return np.array([self._t], dtype=np.float32), 1.0, False, False, self.info(action)

    def info(self, action: np.int64) -> dict[str, Any]:
        return {}


class BigInfoEnv(_CountEnv):
    """From its step number ``after`` + 1 on, a step info ``"big"`` of ``mb`` MB (float64 ones: a
    rendered frame, say), which takes an answer past the largest message (64 MiB) at 70; ``reset_mb``:
    a reset info ``"big"`` of that many MB too."""

    def __init__(self, mb: float = 70.0, after: int = 1, reset_mb: float = 0.0) -> None:
        super().__init__()
        self.size, self.after = int(mb * 1e6 / 8), after
        self.reset_size = int(reset_mb * 1e6 / 8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, ({"big": np.ones(self.reset_size)} if self.reset_size else info)

    def info(self, action: np.int64) -> dict[str, Any]:
        return {"big": np.ones(self.size)} if self._t > self.after else {}


class InfoWidthEnv(_CountEnv):
    """A step info ``"v"`` of ``width`` values: servers of different widths give infos that do not fit
    together (the same key, another shape per env)."""

    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.width = width

    def info(self, action: np.int64) -> dict[str, Any]:
        return {"v": np.full(self.width, self._t)}


class BrokenStepEnv(FaultyEnv):
    """A FaultyEnv whose every step fails its server's vector env as a whole (as at FaultyEnv's
    ``bad_reward_at``): a server that answers handshakes and resets at once and
    fails each step (INTERNAL), the way a flapping server does."""

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.bad_reward_at = self._steps + 1
        return super().step(action)


class WideActionEnv(ClockEnv):
    """A ClockEnv whose actions are Box(width,) float64 (the first element is the Box ClockEnv's):
    requests as large as a test wants, 8 bytes an element of each env's action."""

    def __init__(self, width: int = 64) -> None:
        super().__init__(action="box")
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(width,), dtype=np.float64)


class BoundsEnv(gym.Env[dict[str, Any], np.ndarray]):
    """Box spaces of every kind of bounds: of one value (sent as that value to learners that read compact
    bounds: a camera's 0 and 255, a vector's infinities, an integer Box with no upper bound at all) and not
    (per-element bounds, an integer Box unbounded below in one element only), bool, in a Dict and a Tuple.
    Observations and actions all zeros (within every bound)."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Dict(
            {
                "camera": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8),
                "vector": gym.spaces.Box(
                    np.array([-1.0, -2.0, -3.0], np.float32), np.array([1.0, 2.0, np.inf], np.float32), dtype=np.float32
                ),
                "free": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                "counts": gym.spaces.Box(np.array([-np.inf, 0.0, 0.0]), np.inf, (3,), np.int64),
                "switches": gym.spaces.Box(0, 1, (2, 2), cast(Any, np.bool_)),
                "pair": gym.spaces.Tuple((gym.spaces.Box(-1.0, 1.0, (2,), np.float64), gym.spaces.Discrete(3))),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)

    def _obs(self) -> dict[str, Any]:
        spaces = cast(gym.spaces.Dict, self.observation_space).spaces
        obs: dict[str, Any] = {k: np.zeros(s.shape, s.dtype) for k, s in spaces.items() if k != "pair"}
        obs["pair"] = (np.zeros(2), np.int64(0))
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        return self._obs(), 0.0, False, False, {}


class SlowResetEnv(ClockEnv):
    """A ClockEnv whose resets from number ``slow_from`` on (counted over the env's life) take ``sleep_s``
    seconds: a server that answers its first reset, then misses a short deadline on every reset after."""

    def __init__(self, slow_from: int = 2, sleep_s: float = 3.0) -> None:
        super().__init__()
        self.slow_from, self.sleep_s = slow_from, sleep_s
        self._resets = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self._resets += 1
        if self._resets >= self.slow_from:
            time.sleep(self.sleep_s)
        return super().reset(seed=seed, options=options)


class MixedInfoEnv(_CountEnv):
    """Step infos whose type follows the action: ``"x"`` 0.5 for action 1, the int 1 for action 0, and
    ``"d": {"y": ...}`` a float32 1.5 or the int 2 (as FrozenLake's ``prob``: an int after a reset, a
    float after a step)."""

    def info(self, action: np.int64) -> dict[str, Any]:
        return {"x": 0.5 if action else 1, "d": {"y": np.float32(1.5) if action else 2}}


class OptionsProbeEnv(ClockEnv):
    """A ClockEnv whose reset info says what ``options`` its reset got: ``"options"`` is -1 for None,
    else how many options (0 for ``{}``, which an env may read with ``options.get``)."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed)
        return obs, {**info, "options": -1 if options is None else len(options)}


class InPlaceEnv(ClockEnv):
    """A ClockEnv (Box actions of 2) that changes what it is given in place, as some envs do: it clips
    its action (``np.clip(a, -0.5, 0.5, out=a)``; the reward is the clipped action's sum) and adds 1 to
    a reset's ``options["goal"]`` (the reset info's ``"goal"`` is what it made of it)."""

    def __init__(self, length: int = 3) -> None:
        super().__init__(length=length, action="box")
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed)
        if options and "goal" in options:
            options["goal"] += 1
            info["goal"] = options["goal"].copy()
        return obs, info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        np.clip(action, -0.5, 0.5, out=action)
        obs, _, terminated, truncated, _ = super().step(action)
        return obs, float(action.sum()), terminated, truncated, {"seen": action.copy()}


class Opaque:
    """An info value of a type no wire form carries (its repr names its number)."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"Opaque({self.number})"


class UnsendableInfoEnv(_CountEnv):
    """Step infos no wire form carries as they are: an arbitrary object, a set, a dict with an int key,
    a complex number; and ``"ok"``, one that it does."""

    def info(self, action: np.int64) -> dict[str, Any]:
        return {
            "obj": Opaque(self._t),
            "s": {1, 2},
            "d": {1: "a"},
            "c": np.complex128(1 + 2j),
            "ok": self._t,
        }


class _CodedError(Exception):
    """An exception whose ``__init__`` takes other arguments than its ``args``: it pickles, but unpickles as a
    TypeError (pickle calls ``_CodedError(*args)``, one argument short)."""

    def __init__(self, code: int, where: str) -> None:
        super().__init__(f"{code} at {where}")
        self.code, self.where = code, where


class UnpicklableInfoEnv(_CountEnv):
    """Step infos that pickle but cannot be unpickled: ``kind`` "exception", an exception of ``_CodedError``'s
    kind (a step's last error, say); "runtime_module", an object of a class in a module made at run time (in
    sys.modules of the process that stepped the env, none of any other's); and ``"ok"``, one that can."""

    def __init__(self, kind: str = "exception") -> None:
        super().__init__()
        self.kind = kind

    def info(self, action: np.int64) -> dict[str, Any]:
        if self.kind == "exception":
            return {"err": _CodedError(self._t, "step"), "ok": self._t}
        module = sys.modules.get("made_at_run_time")
        if module is None:
            import types

            module = sys.modules["made_at_run_time"] = types.ModuleType("made_at_run_time")
            exec("class Thing:\n    def __repr__(self):\n        return 'Thing()'", module.__dict__)
        return {"thing": module.Thing(), "ok": self._t}


class NotUnicodeEnv(_CountEnv):
    """Strings no wire form carries (a lone surrogate: text decoded with errors="surrogateescape", such as a file
    name of bytes that are not UTF-8) in its step infos (a value, a key, a str array), and in the error its step
    ``raise_at`` raises."""

    def __init__(self, raise_at: int = 3) -> None:
        super().__init__()
        self.raise_at = raise_at

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._t + 1 == self.raise_at:
            raise RuntimeError("cannot open caf\udce9.map")
        return super().step(action)

    def info(self, action: np.int64) -> dict[str, Any]:
        return {"s": "caf\udce9", "k\udce9": 1.0, "u": np.array(["x\udce9"]), "ok": "café"}


class ReservedKeyEnv(_CountEnv):
    """From step ``at`` on (counted over the env's life), its step info has the key ``key``, one that
    envfleet reserves; its reset info has it too with ``on_reset``."""

    def __init__(self, key: str = "env_error", at: int = 2, on_reset: bool = False) -> None:
        super().__init__()
        self.key, self.at, self.on_reset = key, at, on_reset
        self._steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, {self.key: 0.0} if self.on_reset else info

    def info(self, action: np.int64) -> dict[str, Any]:
        self._steps += 1
        return {self.key: 0.0} if self._steps >= self.at else {}


class BadObservationEnv(_CountEnv):
    """From step ``at`` on, observations the policy cannot act on: ``kind="nan"``, ``[nan]`` (Box);
    ``kind="discrete"``, 7 for its Discrete(3) space; ``kind="float64"``, ``[1e39]`` in a float64 Box (finite,
    infinite as float32; ``"float64-once"``: at step ``at`` only); ``kind="inf-once"``: ``[inf]`` at step ``at``
    only; ``kind="reward"``: a NaN reward instead
    (``kind="huge"``: 1e30, finite, whose square overflows float32 in the value loss); only
    in an env whose first reset had an odd seed (seeded ``s``, a vector env's env i gets ``s + i``:
    one of two envs)."""

    def __init__(self, kind: str = "nan", at: int = 2) -> None:
        super().__init__()
        self.kind, self.at = kind, at
        self.bad: bool | None = None
        if kind == "discrete":
            self.observation_space = gym.spaces.Discrete(3)  # type: ignore[assignment]
        elif kind in ("float64", "float64-once"):
            self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(1,), dtype=np.float64)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        if self.bad is None:
            self.bad = seed is not None and seed % 2 == 1
        return (0 if self.kind == "discrete" else obs.astype(self.observation_space.dtype)), info

    def step(self, action: np.int64) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs: Any  # (an int for kind="discrete")
        obs, reward, terminated, truncated, info = super().step(action)
        bad = bool(self.bad) and self._t >= self.at
        if self.kind == "discrete":
            obs = 7 if bad else 0
        elif self.kind == "float64":
            obs = np.array([1e39]) if bad else obs.astype(np.float64)
        elif self.kind in ("float64-once", "inf-once"):
            once = bad and self._t == self.at
            obs = np.array([1e39 if self.kind == "float64-once" else np.inf], dtype=self.observation_space.dtype)
            obs = obs if once else np.array([self._t], dtype=self.observation_space.dtype)
        elif bad and self.kind in ("reward", "huge"):
            reward = float("nan") if self.kind == "reward" else 1e30
        elif bad:
            obs = np.array([np.nan], dtype=np.float32)
        return obs, reward, terminated, truncated, info


class MisshapenEnv(gym.Env[np.ndarray, np.int64]):
    """Box(2,) float32 observations, until the env whose first reset had seed ``bad_seed`` (seeded
    ``s``, a vector env's env i gets ``s + i``: env ``bad_seed`` of a server reset with seed 0) turns
    them into zeros of ``shape`` (dtype float32), from its ``at``-th call of ``method`` ("step" or
    "reset", counted over the env's life) on. ``at`` 2 or more: the server's check of each env's first
    observations passes, and the misfit shows only when the vector env stacks a later one."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(self, bad_seed: int = 2, method: str = "step", at: int = 3, shape: tuple[int, ...] = (3,)) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.bad_seed, self.method, self.at, self.shape = bad_seed, method, at, tuple(shape)
        self.bad: bool | None = None
        self.calls = {"reset": 0, "step": 0}

    def _obs(self, method: str) -> np.ndarray:
        self.calls[method] += 1
        if self.bad and method == self.method and self.calls[method] >= self.at:
            return np.zeros(self.shape, dtype=np.float32)
        return np.zeros(2, dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if self.bad is None:
            self.bad = seed == self.bad_seed
        return self._obs("reset"), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self._obs("step"), 1.0, False, False, {}


class StaggeredClockEnv(ClockEnv):
    """ClockEnv whose episodes last ``length`` steps, plus one where the env's last seeded reset had an odd
    seed (a vector env's env i gets ``s + i``: env 1 of a server reset with seed 0): a vector env's
    envs end their episodes at different steps."""

    def __init__(self, length: int = 3, **kwargs: Any) -> None:
        super().__init__(length=length, **kwargs)
        self.base = length

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self.length = self.base + seed % 2
        return super().reset(seed=seed, options=options)


class AbortingEnv(ClockEnv):
    """A ClockEnv whose constructor aborts the process (SIGABRT, as a simulator's failed assertion in C
    does), without a word on stderr."""

    def __init__(self) -> None:
        os.abort()


class _TwoArgumentError(Exception):
    """An error that pickles but does not unpickle: its ``__init__`` takes other arguments than its ``args``."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


class EndsInWorkerEnv(ClockEnv):
    """A ClockEnv whose constructor, in an async vectorization worker (not in the server's process), ends the worker
    without an error to report: ``os._exit(code)``, or the signal ``signal_number`` where one is given (a crash in
    native code); or (``unreadable``) raises an error that does not unpickle."""

    def __init__(self, code: int = 3, signal_number: int = 0, unreadable: bool = False) -> None:
        import multiprocessing  # (here: the rest of this module has no use for it)

        if multiprocessing.parent_process() is not None:
            if unreadable:
                raise _TwoArgumentError("simulator", "licence not found")
            if signal_number:
                os.kill(os.getpid(), signal_number)
            os._exit(code)
        super().__init__()


class SimulatorBuildEnv(ClockEnv):
    """A ClockEnv whose constructor starts a process of its own (a simulator, whose command line holds
    ``marker``, sleeping ``sim_s`` seconds), then takes ``build_s`` seconds (the simulator loading)."""

    def __init__(self, marker: str, build_s: float = 60.0, sim_s: float = 60.0) -> None:
        import subprocess  # (here: the rest of this module has no use for them)
        import sys

        self.simulator = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({sim_s}); {marker!r}"])
        time.sleep(build_s)
        super().__init__()


def lazy_half_cheetah(**kwargs: Any) -> gym.Env[Any, Any]:
    """HalfCheetah-v5 made by a factory that imports MuJoCo only as it builds the env (a user's env class
    may): its model's deprecation warning comes before any handler could be set from the module."""
    from gymnasium.envs.mujoco.half_cheetah_v5 import HalfCheetahEnv

    return HalfCheetahEnv(**kwargs)
