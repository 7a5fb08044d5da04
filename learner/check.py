"""``learner check``: what an env gives through an env server, against gymnasium's own vector env of it.

An env author's compliance check (as dm_env_rpc's compliance suite is): the env built as a server builds it,
gymnasium's env checker on one copy, then one local server and an in-process ``SyncVectorEnv`` stepped with
the same seeds and random actions (the server's vectorization and autoreset mode), their outputs compared
exactly. The env's own code on the check's side (the env checker's copy, the in-process vector env) runs in a
worker process (:class:`_Worker`): an env that ends or hangs it fails the check, which still gives its verdict.
:func:`run_check` returns the findings; the ``learner`` command prints them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Literal, NoReturn

import gymnasium as gym
import numpy as np

from env_server.config import ServerConfig
from env_server.envs import EnvBuildError, WideInfoSyncVectorEnv, build_one_env, misfit_message
from learner.errors import EnvCrashedError, EnvFleetError

__all__ = ["CheckLine", "CheckOptions", "CheckResult", "run_check", "server_config"]

Status = Literal["ok", "warning", "failed", "info"]

# (README "Your own env": a value with no wire form comes as its repr, cut to this many characters)
_REPR_CHARS = 10_000
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# (env_server.server's line when an env call outlasts --hang-timeout, the server then exiting)
_HUNG = re.compile(r"the envs' \w+ has run for [\d.]+ s, longer than --hang-timeout [\d.]+ s")


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """What to check: the env as ``env-server`` options name it, and how long to step it."""

    env: str
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_envs: int = 2
    steps: int = 1000
    seed: int = 0
    max_episode_steps: int | None = None
    wrappers: tuple[str, ...] = ()
    transport: str | None = None  # (None: LocalServers' default)
    step_socket: bool = True
    # (the server's --hang-timeout, and the longest call of the check's worker process; None: LocalServers' default,
    # 60 s; 0: never)
    hang_timeout: float | None = None
    vectorization: str = "sync"  # (the server's --vectorization and --autoreset-mode: as the operator serves it)
    autoreset_mode: str = "NextStep"


@dataclasses.dataclass(frozen=True)
class CheckLine:
    """One finding: which check, ok / warning / failed / info, and what it found (one line)."""

    check: str
    status: Status
    message: str


@dataclasses.dataclass
class CheckResult:
    """The findings, in the order found; failed when one is, whatever the warnings. ``on_line``: called with each
    line as it is found (the command prints it then: an env that hangs is seen hanging after the lines before)."""

    lines: list[CheckLine] = dataclasses.field(default_factory=list)
    on_line: Callable[[CheckLine], None] | None = None

    def add(self, check: str, status: Status, message: str) -> None:
        line = CheckLine(check, status, message)
        self.lines.append(line)
        if self.on_line is not None:
            self.on_line(line)

    @property
    def failed(self) -> bool:
        return any(line.status == "failed" for line in self.lines)

    @property
    def warnings(self) -> int:
        return sum(line.status == "warning" for line in self.lines)


# What an env's own code may raise, BaseExceptions too (asyncio.CancelledError, GeneratorExit, SystemExit, an env's
# own subclass): the env's error, as the server takes it (env_server.isolation), not a traceback of the check's;
# but for a KeyboardInterrupt, which in this process is the user's Ctrl-C (see _ctrl_c).
_ENV_RAISED = BaseException


def _ctrl_c(err: BaseException) -> None:
    """Raise ``err`` on where it is a KeyboardInterrupt: the user's Ctrl-C, not the env's error (but in the check's
    worker process, which no Ctrl-C reaches: there it is the env's own)."""
    if isinstance(err, KeyboardInterrupt) and not _in_worker:
        raise err


_in_worker = False  # (set in the check's worker process, see _serve)


class _EnvRaised(Exception):
    """Env ``index`` of the in-process vector env raised ``error`` in ``method``."""

    def __init__(self, index: int, method: str, error: BaseException) -> None:
        super().__init__(f"env {index}'s {method} raised {type(error).__name__}: {_one_line(error)}")
        self.index = index


class _Timed(gym.Wrapper[Any, Any, Any, Any]):
    """Times the env's own steps, and names the env (its index) in what its reset or step raises."""

    def __init__(self, env: gym.Env[Any, Any], index: int) -> None:
        super().__init__(env)
        self.index = index
        self.step_s = 0.0
        self.steps = 0
        self.last: tuple[Any, str] = (None, "")  # (the last observation, and the method that returned it)

    def reset(self, **kwargs: Any) -> Any:
        try:
            obs, info = self.env.reset(**kwargs)
        except _ENV_RAISED as err:
            _ctrl_c(err)
            raise _EnvRaised(self.index, "reset", err) from err
        self.last = (obs, "reset")
        return obs, info

    def step(self, action: Any) -> Any:
        start = time.perf_counter()
        try:
            result = self.env.step(action)
        except _ENV_RAISED as err:
            _ctrl_c(err)
            raise _EnvRaised(self.index, "step", err) from err
        self.step_s += time.perf_counter() - start
        self.steps += 1
        self.last = (result[0], "step")
        return result


class _Collected(logging.Filter):
    """Takes the warnings (and worse) of the local server's forwarded log lines out of the log, kept for the check's
    own lines (shown once); its other lines go on as they would."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.lines.append(f"{record.levelname} {record.name}: {_one_line(record.getMessage())}")
        return False


# -- the check's worker process: where the env's own code runs on the check's side -----------------------------


class _InProcessError(Exception):
    """What the in-process side answered instead of a result: the env raised (``text``: "env 0's step raised
    ..."), gymnasium's vector env refused what the envs gave (``misfit``: the env whose observation does not fit,
    else None, and ``text``: the error), or the worker's process was lost (``lost``: killed by the env, or hung)."""

    def __init__(self, kind: Literal["raised", "misfit", "lost"], text: str, misfit: str | None = None) -> None:
        super().__init__(text)
        self.kind, self.text, self.misfit = kind, text, misfit

    def line(self, where: str, step: int | str, after: str = "") -> str:
        """The failed line: ``where`` the vector env refused (its reset, its step ``step``), ``after`` an env's
        error."""
        if self.kind == "raised":
            return f"in-process {self.text}{after}"
        if self.kind == "misfit" and self.misfit is not None:
            return self.misfit + (f" (at step {step})" if step else "")
        return self.text if self.kind == "lost" else f"{where}: {self.text}"


class _Worker:
    """The check's worker process, where the env's own code runs on the check's side (the env checker's copy, the
    in-process vector env), so that an env that ends its process (os._exit, a segfault) or hangs fails the check
    with a line naming it, instead of ending the check or blocking it with no verdict. A fresh interpreter, as
    multiprocessing's spawn starts one (but without the resource tracker that spawn starts too, a process of the
    check's that would outlive the check), never a fork of this process, which holds gRPC channels. In a process group of its own: a terminal's
    Ctrl-C is the check's, which kills the worker as it ends. Answers come back pickled (arrays, plain Python).

    ``hang_timeout``: seconds a call may run (0: for ever), then the worker is killed, and the call fails."""

    def __init__(self, hang_timeout: float) -> None:
        self.hang_timeout = hang_timeout
        self.lost: str | None = None  # (why the worker is gone)
        self._doing: str | None = None  # (the call sent, not answered yet)
        self._sent = 0.0
        ours, theirs = socket.socketpair()
        with theirs:
            code = (
                f"import sys; sys.path[:] = {sys.path!r}; from learner.check import _serve; _serve({theirs.fileno()})"
            )
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", code], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, process_group=0
                )
            except BaseException:  # (no worker: its end of the pair closed too, not left to the GC)
                ours.close()
                raise
        self._conn = Connection(ours.detach())

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._conn.close()  # (an idle worker ends on that)
        if self._process.poll() is None and self._doing is None and self.lost is None and exc_info[0] is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5.0)
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def ask(self, doing: str, command: str, *args: Any) -> Any:
        """Run ``command`` in the worker (``doing``: what it does, in words) and return its answer; raises
        _InProcessError."""
        self.send(doing, command, *args)
        return self.answer()

    def send(self, doing: str, command: str, *args: Any) -> None:
        if self.lost is not None:
            raise _InProcessError("lost", self.lost)
        self._doing, self._sent = doing, time.monotonic()
        with contextlib.suppress(OSError):  # (the worker gone: answer() says why)
            self._conn.send_bytes(pickle.dumps((command, args)))

    def answer(self) -> Any:
        """The answer to the call sent (the worker killed, and _InProcessError raised, once it has run for longer
        than ``hang_timeout``)."""
        left = max(0.0, self._sent + self.hang_timeout - time.monotonic()) if self.hang_timeout else None
        if not self._conn.poll(left):
            self._process.kill()
            self._process.wait()
            self.lost = (
                f"the env hung in the check's worker process: {self._doing} ran for longer than --hang-timeout "
                f"{self.hang_timeout:g} s (the process killed)"
            )
            raise _InProcessError("lost", self.lost)
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._gone()
        self._doing = None
        try:
            kind, *answer = pickle.loads(data)
        except Exception as err:  # (read back in the worker: a class only its process has, a module it made)
            text = f"the worker's answer cannot be read in the check's process: {type(err).__name__}: {_one_line(err)}"
            raise _InProcessError("misfit", text) from None
        if kind == "ok":
            return answer[0]
        raise _InProcessError(kind, *answer)

    @property
    def idle(self) -> bool:
        """Whether the worker is there, and not running a call."""
        return self.lost is None and self._doing is None

    def _gone(self) -> NoReturn:
        """The worker's process has ended (its end of the socket closed): why, as a failed line says it."""
        try:
            code = self._process.wait(5.0)
        except subprocess.TimeoutExpired:  # (it closed the socket, but lives: ended by force)
            self._process.kill()
            code = self._process.wait()
        how = f"exit code {code}" if code >= 0 else f"signal {-code}"
        if code < 0 and -code in signal.valid_signals():
            how += f" ({signal.Signals(-code).name})"
        self.lost = f"the env killed the check's worker process: {how} during {self._doing}"
        raise _InProcessError("lost", self.lost)


class _Reference:
    """The in-process vector env in the worker, as the comparison calls it (answers: see _Here)."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker

    def make(self, config: ServerConfig) -> None:
        self.worker.ask("the build of the in-process vector env", "make", config)

    def reset(self, **kwargs: Any) -> tuple[Any, ...]:
        what = f"seed={kwargs['seed']!r}" if "seed" in kwargs else "options={'reset_mask': ...}"
        return tuple(self.worker.ask(f"the in-process reset({what})", "reset", kwargs))

    def step_async(self, actions: Any, which: str) -> None:
        self.worker.send(f"the in-process {which}", "step", actions)

    def step_wait(self) -> tuple[Any, ...]:
        return tuple(self.worker.answer())

    def timing(self) -> tuple[float, int]:
        """The env's own steps: seconds in all, and how many."""
        return tuple(self.worker.ask("the timing", "timing"))

    def close(self) -> str | None:
        """Close the in-process envs; what their close raised, in a line (None where it raised nothing, or where
        the worker is gone or still busy: it is killed)."""
        if not self.worker.idle:
            return None
        try:
            return self.worker.ask("the in-process close", "close")
        except _InProcessError:
            return None


class _Here:
    """The worker's side: what each call does (answers ``("ok", value)``, else ``("raised", text)`` or
    ``("misfit", text, misfit)``: see _InProcessError)."""

    def __init__(self) -> None:
        self.wrapped: list[_Timed] = []
        self.local: gym.vector.VectorEnv | None = None

    def build(self, config: ServerConfig) -> tuple[str, Any]:
        """Check 1: the env built as the server builds it, and gymnasium's env checker on that copy: the server's
        reason where the build fails, else the spaces, what the checker found, and what close raised."""
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                env = build_one_env(config)
                try:
                    from gymnasium.utils.env_checker import check_env

                    check_env(env.unwrapped, skip_render_check=True, skip_close_check=True)
                    stopped = None
                except _ENV_RAISED as err:  # (an AssertionError of the checker's, or the env's own error)
                    _ctrl_c(err)
                    stopped = f"stopped: {type(err).__name__}: {_one_line(err)}"
                closing = _closed(env)
        except EnvBuildError as err:
            return ("ok", str(err))
        spaces = f"{_space(env.observation_space)} observations, {_space(env.action_space)} actions"
        found = list(dict.fromkeys(_warning_text(w.message) for w in caught)) + ([stopped] if stopped else [])
        return ("ok", (spaces, found, closing))

    def make(self, config: ServerConfig) -> tuple[str, Any]:
        def maker(index: int) -> Callable[[], gym.Env[Any, Any]]:
            def make() -> gym.Env[Any, Any]:
                env = _Timed(build_one_env(config), index)
                self.wrapped.append(env)
                return env

            return make

        with warnings.catch_warnings():  # (the env checker's said them once; gym.make's checker would again)
            warnings.simplefilter("ignore")
            # (infos widened as the server widens them, and the learner's --backend gym: gymnasium's own
            # SyncVectorEnv casts an info key's values to its first env's type, FrozenLake's prob 0.333 to 0 after
            # an int 1)
            mode = gym.vector.AutoresetMode(config.autoreset_mode)
            self.local = WideInfoSyncVectorEnv([maker(i) for i in range(config.num_envs)], autoreset_mode=mode)
        return ("ok", None)

    def reset(self, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return self._call(lambda local: local.reset(**kwargs))

    def step(self, actions: Any) -> tuple[Any, ...]:
        return self._call(lambda local: local.step(actions))

    def timing(self) -> tuple[str, Any]:
        return ("ok", (sum(env.step_s for env in self.wrapped), sum(env.steps for env in self.wrapped)))

    def close(self) -> tuple[str, Any]:
        return ("ok", None if self.local is None else _closed(self.local))

    def _call(self, call: Callable[[gym.vector.VectorEnv], Any]) -> tuple[Any, ...]:
        assert self.local is not None  # (made first)
        try:
            return ("ok", call(self.local))
        except _EnvRaised as err:
            return ("raised", str(err))
        except Exception as err:  # (gymnasium's vector env refusing what the envs gave: a ragged observation)
            return ("misfit", f"{type(err).__name__}: {_one_line(err)}", _misfit(self.wrapped))


def _serve(fd: int) -> None:
    """The check's worker process (see _Worker): answers the calls that come on the socket ``fd`` until it closes
    (or a close call), and ends where the check's process has gone without closing it (a hung env, say)."""
    global _in_worker
    _in_worker = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C sent to its process group is the check's)
    threading.Thread(target=_end_with, args=(os.getppid(),), daemon=True).start()
    here, conn = _Here(), Connection(fd)
    while True:
        try:
            command, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            answer = getattr(here, command)(*args)
        except BaseException as err:  # (nothing of the env's ends the worker but its process's own end)
            answer = ("misfit", f"{type(err).__name__}: {_one_line(err)}", None)
        try:
            data = _pickled(answer)
        except Exception as err:  # (a value whose repr raises, say: said, not an end of the worker's)
            text = f"the worker's answer cannot be pickled: {type(err).__name__}: {_one_line(err)}"
            data = pickle.dumps(("misfit", text, None))
        conn.send_bytes(data)
        if command == "close":
            return


def _end_with(parent: int) -> None:
    """In the worker: end it once its parent (the check) has gone, whatever the env is doing."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _pickled(answer: tuple[Any, ...]) -> bytes:
    """``answer`` pickled; a value that pickle cannot carry (an info's lock, say) as an _Unpicklable of its repr.
    Read back here first: some values pickle but do not unpickle (an exception whose ``__init__`` takes other
    arguments than its args raises TypeError), which the check's side would meet instead of the answer."""
    try:
        data = pickle.dumps(answer)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(_picklable(answer))


def _picklable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _picklable(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        items = [_picklable(item) for item in value]
        if type(value) in (tuple, list):
            return type(value)(items)
        with contextlib.suppress(
            Exception
        ):  # (a subclass: a namedtuple takes its items one an argument; else its repr)
            value = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, np.ndarray) and value.dtype == object:
        out = np.empty(value.shape, dtype=object)
        for index, item in np.ndenumerate(value):
            out[index] = _picklable(item)
        return out
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return _Unpicklable(repr(value)[:_REPR_CHARS], f"{type(value).__module__}.{type(value).__qualname__}")
    return value


@dataclasses.dataclass(frozen=True)
class _Unpicklable:
    """An in-process value that pickle cannot carry back from the worker: its repr, and its type's name (what the
    comparison needs of it: the server sends such a value as its repr)."""

    text: str
    kind: str

    def __repr__(self) -> str:
        return self.text


def server_config(options: CheckOptions) -> ServerConfig:
    """The config of the server ``options`` describe; raises ValueError (naming the option) for options the server
    refuses."""
    try:
        return ServerConfig(
            env=options.env,
            env_kwargs=options.env_kwargs,
            num_envs=options.num_envs,
            max_episode_steps=options.max_episode_steps,
            wrappers=options.wrappers,
            vectorization=options.vectorization,
            autoreset_mode=options.autoreset_mode,
        )
    except ValueError as err:
        raise ValueError(f"--{err}") from None  # ("env: expected a gymnasium id ...")


def run_check(options: CheckOptions, on_line: Callable[[CheckLine], None] | None = None) -> CheckResult:
    """Check the env ``options`` names (``on_line``: see CheckResult); raises ValueError (naming the option) for
    options the server refuses (see :func:`server_config`), and nothing for what the env does: that is a failed
    check."""
    config = server_config(options)
    result = CheckResult(on_line=on_line)

    from learner.local import HANG_TIMEOUT_S

    hang_timeout = HANG_TIMEOUT_S if options.hang_timeout is None else options.hang_timeout
    with _Worker(hang_timeout) as worker:
        # 1. built as the server builds it, and gymnasium's env checker on that copy (in the worker, while the server
        # starts: its lines come first all the same)
        worker.send("the build and gymnasium's env checker", "build", config)
        _serve_and_compare(options, config, worker, result, hang_timeout)
    return result


def _built(options: CheckOptions, worker: _Worker, result: CheckResult) -> bool:
    """Check 1's lines, from the worker's answer to its build call; whether the env was built."""
    try:
        built = worker.answer()
    except _InProcessError as err:  # (the worker's process killed, or hung)
        result.add("build", "failed", err.line("the build and gymnasium's env checker", ""))
        return False
    if isinstance(built, str):
        result.add("build", "failed", built)
        return False
    spaces, found, closing = built
    result.add("build", "ok", f"{options.env} as the server builds it: {spaces}")
    for text in found:
        result.add("env checker", "warning", text)
    if not found:
        result.add("env checker", "ok", "gymnasium's env checker found nothing")
    if closing is not None:
        result.add("close", "warning", f"the env's {closing}")
    return True


def _serve_and_compare(
    options: CheckOptions,
    config: ServerConfig,
    worker: _Worker,
    result: CheckResult,
    hang_timeout: float,
) -> None:
    """Checks 2-6: one local server (its log lines kept) against the in-process vector env in ``worker``, whose
    build call (check 1) is answered once the server has started."""
    from learner.local import DEFAULT_TRANSPORT, LocalServers, server_logger_name
    from learner.remote import RemoteVectorEnv

    server_args = [f"--max-episode-steps={options.max_episode_steps}"] if options.max_episode_steps else []
    server_args += [f"--wrappers={','.join(options.wrappers)}"] if options.wrappers else []
    server_args += [f"--vectorization={config.vectorization}", f"--autoreset-mode={config.autoreset_mode}"]
    collected = _Collected()
    server_log = logging.getLogger(server_logger_name(0))
    server_log.addFilter(collected)
    building = True  # (the worker's build call not answered yet)
    try:
        with (
            LocalServers(
                options.env,
                1,
                options.num_envs,
                env_kwargs=options.env_kwargs,
                server_args=server_args,
                log_level="warning",
                log_format="json",  # (a record a line: a traceback in it, left out here)
                restarts=0,
                transport=options.transport or DEFAULT_TRANSPORT,
                hang_timeout=hang_timeout,
            ) as servers,
            RemoteVectorEnv(servers.addresses, step_socket=options.step_socket) as remote,
        ):
            if not _built(options, worker, result):  # (the server's lines, of an env that cannot be built: none)
                return
            building = False
            result.add("server", "ok", f"{options.num_envs} envs on {servers.addresses[0]}")
            _policy(remote.single_observation_space, remote.single_action_space, result)
            _compare(options, config, remote, _Reference(worker), result)
    except EnvFleetError as err:  # (the server's start, or a remote call: it names the server and the env)
        if building and not _built(options, worker, result):
            return
        result.add("server", "failed", _one_line(err))
    finally:
        server_log.removeFilter(collected)
    hung = next((match for line in collected.lines if (match := _HUNG.search(line))), None)
    if hung is not None:  # (what failed above said the server went: say why, before its log line)
        result.add("hang", "failed", f"the env hung: {hung.group(0)} (where: the server log below)")
    for line in collected.lines:
        result.add("server log", "warning", line)
    if not collected.lines:
        result.add("server log", "ok", "no warnings")


def _policy(observation_space: gym.Space[Any], action_space: gym.Space[Any], result: CheckResult) -> None:
    """Check 2b: whether ``learner train`` takes the spaces as a learner gets them from the server (its checks
    before a run: the observations' kind, the Nature CNN's size, the action space), with the policy and the preset
    it would train them with: a warning where it refuses them (the env serves, and RemoteVectorEnv steps it, but
    PPO cannot train it as it is: flattened, say), or where torch, the learner's extra, is not installed."""
    try:
        from learner.config import pick_preset
        from learner.ppo import check_trainable, describe_policy
    except ImportError as err:
        result.add("policy", "info", f"learner train's policy not checked: {err} (pip install 'envfleet[learner]')")
        return
    try:
        check_trainable(observation_space, action_space)
    except ValueError as err:
        result.add("policy", "warning", f"learner train refuses it: {err}")
        return
    policy = describe_policy(observation_space)
    preset = pick_preset("auto", observation_space, action_space)
    result.add("policy", "ok", f"learner train takes it: {policy}, the {preset} preset")


def _compare(
    options: CheckOptions, config: ServerConfig, remote: gym.vector.VectorEnv, local: _Reference, result: CheckResult
) -> None:
    """Checks 3-5: reproducibility, equivalence and timing of ``remote`` against ``config``'s envs in-process (in
    the check's worker process: ``local``)."""
    n = options.num_envs
    mode = gym.vector.AutoresetMode(config.autoreset_mode)  # (the server's: compared step for step)
    try:
        # 4. reproducibility, first: an env that is not reproducible cannot be compared value for value
        try:
            local.make(config)
        except _InProcessError as err:
            result.add("equivalence", "failed", err.line("in-process SyncVectorEnv's build", ""))
            return
        try:
            first = local.reset(seed=options.seed)
            again = local.reset(seed=options.seed)
        except _InProcessError as err:  # (gymnasium's vector env refusing what the envs gave: an info that is no dict)
            result.add("equivalence", "failed", err.line("in-process SyncVectorEnv's reset", ""))
            return
        exact = _difference(first[0], again[0], "observation", exact=True, notes={}) is None
        if exact:
            result.add("reproducibility", "ok", f"reset(seed={options.seed}) twice gives the same observations")
        else:
            result.add(
                "reproducibility",
                "warning",
                f"reset(seed={options.seed}) twice gives other observations: seeded runs won't repeat (draw from "
                "self.np_random, seeded by super().reset(seed=seed)); compared below: types, dtypes and shapes only",
            )
        if exact and config.vectorization == "vector_entry_point":  # (env-server --help: "vectorization")
            exact = False
            result.add(
                "equivalence",
                "warning",
                "--vectorization vector_entry_point: the env's own batched implementation draws from other random "
                "streams than gymnasium's per-env seeding, compared against here; compared below: types, dtypes and "
                "shapes only",
            )

        # 3. equivalence: the same seed and random actions through both
        remote.action_space.seed(options.seed)
        notes: dict[str, str] = {}
        unusable: dict[str, str] = {}
        remote_s, step = 0.0, 0
        try:
            local_out: tuple[Any, ...] = local.reset(seed=options.seed)
            remote_out: tuple[Any, ...] = remote.reset(seed=options.seed)
            found = _first_difference(("observation", "info"), local_out, remote_out, exact, notes)
            _unusable(local_out[0], None, "the reset", unusable)
            while found is None and step < options.steps:
                step += 1
                actions = remote.action_space.sample()
                # (both at once, the worker's step sent first (the actions pickled: a copy), the served one waited
                # for first: an env whose step hangs is ended by the server's --hang-timeout, a failed check naming
                # the server's log; the worker's by the same timeout, where it hangs in-process only)
                local.step_async(actions, f"step {step}")
                start = time.perf_counter()
                try:
                    remote_out = remote.step(copy.deepcopy(actions))
                except EnvCrashedError:  # (the env raised there: in-process, its error names its own exception)
                    local.step_wait()
                    raise
                remote_s += time.perf_counter() - start
                local_out = local.step_wait()
                fields = ("observation", "reward", "terminated", "truncated", "info")
                found = _first_difference(fields, local_out, remote_out, exact, notes)
                _unusable(local_out[0], local_out[1], f"step {step}", unusable)
                if found is None and mode is gym.vector.AutoresetMode.DISABLED:
                    found = _reset_ended(local, local_out, remote, remote_out, exact, notes)
        except _InProcessError as err:  # (the env raised, or gymnasium's vector env refused what the envs gave)
            where = f"in-process SyncVectorEnv at step {step}"
            result.add(
                "equivalence", "failed", err.line(where, step, f" (at step {step} after reset(seed={options.seed}))")
            )
            return
        except EnvFleetError as err:  # (it names the server and the env)
            result.add("equivalence", "failed", f"served: {_one_line(err)} (at step {step})")
            return
        for key, what in notes.items():
            result.add("equivalence", "warning", f"info key {key!r}: {what} (README: Your own env)")
        for what in unusable.values():
            result.add("usable", "warning", what)
        if found is not None:
            where = "the reset" if step == 0 else f"step {step}"
            result.add(
                "equivalence",
                "failed",
                f"{where}: {found} (in-process vs served; an env that draws from a generator reset(seed=...) does not "
                "seed, not self.np_random, differs so too)",
            )
            return
        how = "the same" if exact else "of the same types, dtypes and shapes"
        how += " (but for the warnings above)" if notes else ""
        result.add("equivalence", "ok", f"{step} steps x {n} envs: observations, rewards, flags and infos {how}")

        # 5. timing
        try:
            own_s, env_steps = local.timing()
        except _InProcessError as err:
            result.add("timing", "failed", err.line("in-process SyncVectorEnv's timing", ""))
            return
        own_us = 1e6 * own_s / (env_steps or 1)
        remote_us = 1e6 * remote_s / (max(step, 1) * n)
        if own_us < remote_us / 2:
            advice = "a fast env, the round trip is most of it: more envs per server (--num-envs)"
        else:
            advice = "a slow env, its own step is most of it: more servers (or --vectorization async)"
        result.add(
            "timing",
            "info",
            f"the env's step {own_us:,.1f} us in-process; served: {remote_us:,.1f} us per env-step "
            f"({n} envs on 1 server): {advice}",
        )
    finally:
        closing = local.close()
        if closing is not None:
            result.add("close", "warning", f"the in-process envs' {closing}")


def _reset_ended(
    local: _Reference,
    local_out: tuple[Any, ...],
    remote: gym.vector.VectorEnv,
    remote_out: tuple[Any, ...],
    exact: bool,
    notes: dict[str, str],
) -> str | None:
    """Under autoreset mode Disabled, nothing resets an env that ended: each side's ended envs are reset as a
    learner of such a server resets them (``reset(options={"reset_mask": ...})``), their observations and infos
    compared; where they first differ, else None. (Each side its own: compared by types only, they end apart.)"""
    local_ended, remote_ended = (np.logical_or(out[2], out[3]) for out in (local_out, remote_out))
    if not (local_ended.any() or remote_ended.any()):
        return None
    local_reset = local.reset(options={"reset_mask": local_ended}) if local_ended.any() else local_out[::4]
    remote_reset = remote.reset(options={"reset_mask": remote_ended}) if remote_ended.any() else remote_out[::4]
    found = _first_difference(("observation", "info"), local_reset, remote_reset, exact, notes)
    return None if found is None else f"the reset of the envs that ended then: {found}"


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _unusable(
    obs: Any, rewards: np.ndarray | None, when: str, found: dict[str, str], where: str = "observation"
) -> None:
    """Note in ``found`` (once each) the first NaN or infinite observation or reward of ``when``, and the first
    float64 observation beyond float32's range: the same through a server, so no difference, but learner train and
    eval stop on them (README: Your own env). ``where`` names the part of a Dict or Tuple observation the batch
    ``obs`` is (``observation['state']``), as learner train's refusal names it."""
    if isinstance(obs, dict):
        for key, value in obs.items():
            _unusable(value, None, when, found, f"{where}[{key!r}]")
    elif isinstance(obs, tuple):
        for i, value in enumerate(obs):
            _unusable(value, None, when, found, f"{where}[{i}]")
    elif isinstance(obs, np.ndarray) and obs.dtype.kind == "f" and obs.size:
        rows = obs.reshape(len(obs), -1) if obs.ndim else obs.reshape(1, 1)
        bad = ~np.isfinite(rows).all(axis=1)
        if "nan" not in found and bad.any():
            env = int(np.flatnonzero(bad)[0])
            found["nan"] = (
                f"{where} of env {env} at {when} has NaN or infinite values ({_short(rows[env])}): learner "
                "train and eval stop on it"
            )
        big = ~bad & (np.abs(rows) > _FLOAT32_MAX).any(axis=1)
        if "big" not in found and big.any():
            env = int(np.flatnonzero(big)[0])
            found["big"] = (
                f"{where} of env {env} at {when} has values beyond float32's range ({_short(rows[env])}): learner "
                "train stops on it unless --norm-obs scales it"
            )
    if rewards is not None and "reward" not in found and not np.isfinite(rewards).all():
        env = int(np.flatnonzero(~np.isfinite(rewards))[0])
        found["reward"] = f"reward of env {env} at {when} is {rewards[env]}: learner train and eval stop on it"


def _misfit(envs: list[_Timed]) -> str | None:
    """What failed the in-process vector env where it refused what the envs gave: the first env whose last
    observation does not fit its space, named as ``--backend gym`` names it; None where none is found."""
    for env in envs:
        obs, method = env.last
        message = misfit_message(obs, env.observation_space, env.index, method, in_process=True) if method else None
        if message is not None:
            return message
    return None


def _closed(env: gym.Env[Any, Any] | gym.vector.VectorEnv) -> str | None:
    """Close ``env``; what its close raised, in a line (None where it raised nothing)."""
    try:
        env.close()
    except _ENV_RAISED as err:
        _ctrl_c(err)
        return f"close raised {type(err).__name__}: {_one_line(err)}"
    return None


def _first_difference(
    fields: tuple[str, ...], local: tuple[Any, ...], remote: tuple[Any, ...], exact: bool, notes: dict[str, str]
) -> str | None:
    for field, a, b in zip(fields, local, remote, strict=True):
        found = _difference(a, b, field, exact, notes)
        if found is not None:
            return found
    return None


def _difference(a: Any, b: Any, where: str, exact: bool, notes: dict[str, str]) -> str | None:
    """Where ``b`` (served) first differs from ``a`` (in-process), with both values; None where it does not. A
    value that came as its repr string (README's first difference) is no difference: noted in ``notes`` by its info
    key, as the server logs it."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = {_wire_key(key): key for key in a}
        if set(keys) != set(b) or len(keys) != len(a):
            return f"{where}: keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
        if any(not isinstance(key, str) for key in a):
            notes.setdefault(_info_key(where), "a dict with keys that are not str comes with str(key) keys")
        for text, key in keys.items():
            if text != key and isinstance(key, str):
                notes.setdefault(text if where == "info" else _info_key(where), "a key not valid Unicode comes escaped")
        for text, key in keys.items():
            found = _difference(a[key], b[text], f"{where}[{text!r}]", exact, notes)
            if found is not None:
                return found
        return None
    if isinstance(a, tuple | list) and type(a) is type(b) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _difference(x, y, f"{where}[{index}]", exact, notes)
            if found is not None:
                return found
        return None
    arrays = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
    reprs = b.dtype.kind == "U" and (a.dtype.kind not in "US" or not all(map(_unicode, a.flat))) if arrays else False
    if arrays and (object in (a.dtype, b.dtype) or reprs):
        for index, (x, y) in enumerate(zip(a.flat, b.flat, strict=True)):  # (item by item)
            found = _difference(x, y, f"{where}[{index}]", exact, notes)
            if found is not None:
                return found
        return None
    as_repr = isinstance(b, str | np.str_) and not (isinstance(a, str) and _unicode(a)) and a is not None
    if as_repr and (not exact or str(b) == repr(a)[:_REPR_CHARS]):
        kind = a.kind if isinstance(a, _Unpicklable) else f"{type(a).__module__}.{type(a).__qualname__}"
        notes.setdefault(_info_key(where), f"a {kind} comes as its repr string")
        return None
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        if not exact:
            return None
        same = (a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind in "fc" else np.equal(a, b)
        if np.all(same):
            return None
        index = np.argwhere(~np.asarray(same))[0]
        env = f", env {index[0]}" if a.ndim else ""
        return f"{where}{env}: {_short(a[tuple(index[:1])])} vs {_short(b[tuple(index[:1])])}"
    if type(a) is not type(b):
        kind = a.kind.rpartition(".")[2] if isinstance(a, _Unpicklable) else type(a).__name__  # (the env's type)
        return f"{where}: {kind} {_short(a)} vs {type(b).__name__} {_short(b)}"
    if exact and not (a == b or (a != a and b != b)):
        return f"{where}: {_short(a)} vs {_short(b)}"
    return None


def _unicode(value: object) -> bool:
    """Whether ``value`` (a str) is valid Unicode: no lone surrogate, which the wire cannot carry."""
    try:
        str(value).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _wire_key(key: object) -> str:
    """The key as it comes over the wire (README "Your own env"): ``str(key)``, a lone surrogate in it
    backslash-escaped (``'caf\\udce9'``)."""
    text = str(key)
    return text if _unicode(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _info_key(where: str) -> str:
    """The top-level info key of a place (``info['s'][0]``: ``s``)."""
    match = re.match(r"info\[('[^']*'|\"[^\"]*\")\]", where)
    return match.group(1)[1:-1] if match else where


def _space(space: gym.Space[Any]) -> str:
    """A space in a few words: its kind, shape and dtype (``Box((4,), float32)``)."""
    if isinstance(space, gym.spaces.Discrete | gym.spaces.Box):
        return (
            f"{type(space).__name__}({space.n})"
            if isinstance(space, gym.spaces.Discrete)
            else (f"Box({space.shape}, {space.dtype})")
        )
    return _short(space)


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 200 else text[:200] + "..."


def _warning_text(message: Warning | str) -> str:
    text = _ANSI.sub("", str(message)).strip()
    return _one_line(text.removeprefix("WARN: "))


def _one_line(value: object) -> str:
    text = " ".join(str(value).split())
    return text if text else type(value).__name__
