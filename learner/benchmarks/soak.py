"""Soak: env servers killed one after another under a stepping learner, every result checked (run by hand).

    python -m learner.benchmarks.soak                          # 10 minutes, a server killed every 30 s
    python -m learner.benchmarks.soak --minutes 1 --kill-every 10 --out soak.json

Local env servers host IndexEnv (``learner.benchmarks.envs``), whose observation is ``[token, index,
t, last_action]``. Every ``--kill-every`` seconds one server (in turn; ``--control`` servers are never
killed) gets SIGKILL and starts again on the same port ``--down`` seconds later. Meanwhile a
``RemoteVectorEnv(fault_tolerant=True)`` steps every env as fast as it can, each env and step with
its own action, and checks every result:

* an env reported available gave the result of the action it was sent this step (``last_action``),
  from the right env (``index``) of the right server process (its current ``token``), exactly one
  step after its previous result (``t``; or a reset step after its episode ended): no result is
  lost, repeated, or given to another env;
* an env reported unavailable keeps its last observation (reward 0) until its server is back, and
  rejoins with a new episode (``t`` 0, no action) from the restarted process (a new ``token``).

It reports the steps, the env steps checked, the errors found (the target: 0), failures and
reconnects, the time from a server's restart to its envs' rejoining (the target: within 10 s), the
slowest step (a hang would show), and the resident memory of the servers never killed and of the
learner, after a warm-up and at the end (the target: growth under 10 %). A benchmark, not a test:
its figures go in the README.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np

from learner.argtypes import number
from learner.local import python_m

__all__ = ["SoakResult", "main", "soak"]

ENV = "learner.benchmarks.envs:IndexEnv"
ACTIONS = 1000  # IndexEnv's Discrete(1000)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    """One env-server subprocess on a fixed port, which can be killed and started again."""

    def __init__(self, num_envs: int, log: IO[str]) -> None:
        self.num_envs = num_envs
        self.log = log
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None
        self.ready_at = 0.0
        self.start("0")

    def start(self, port: str | None = None) -> None:
        port = port if port is not None else self.address.rpartition(":")[2]
        cmd = [*python_m("env_server"), "--env", ENV, "--num-envs", str(self.num_envs)]
        cmd += ["--host", "127.0.0.1", "--port", port, "--log-level", "warning"]
        cmd += ["--parent-pid", str(os.getpid())]  # (the soak killed, its servers exit)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"env-server did not start: {line!r}")
        self.address = line.removeprefix("listening on ")
        self.ready_at = time.monotonic()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@dataclass
class SoakResult:
    """What a soak run measured."""

    seconds: float = 0.0
    servers: int = 0
    envs: int = 0
    steps: int = 0
    env_steps_checked: int = 0
    env_steps_unavailable: int = 0
    errors: int = 0
    """Results that were wrong (another env's, lost, repeated, out of order): the target is 0."""
    error_examples: list[str] = field(default_factory=list)
    kills: int = 0
    failures: int = 0
    reconnects: int = 0
    server_restarts: int = 0
    rejoin_s: list[float] = field(default_factory=list)
    """Per restart: seconds from the server listening again to its envs' rejoining."""
    never_rejoined: int = 0
    slowest_step_s: float = 0.0
    steps_per_s: float = 0.0
    control_rss_mb_start: list[float] = field(default_factory=list)
    control_rss_mb_end: list[float] = field(default_factory=list)
    learner_rss_mb_start: float = 0.0
    learner_rss_mb_end: float = 0.0

    def summary(self) -> dict[str, Any]:
        rejoin = np.array(self.rejoin_s) if self.rejoin_s else np.array([np.nan])
        growth = [
            (end / start - 1) * 100
            for start, end in zip(self.control_rss_mb_start, self.control_rss_mb_end, strict=True)
            if start > 0
        ]
        return {
            **{k: v for k, v in asdict(self).items() if k not in ("rejoin_s",)},
            "rejoin_s_p50": round(float(np.median(rejoin)), 3),
            "rejoin_s_max": round(float(rejoin.max()), 3),
            "control_rss_growth_pct": [round(g, 2) for g in growth],
            "learner_rss_growth_pct": round((self.learner_rss_mb_end / self.learner_rss_mb_start - 1) * 100, 2)
            if self.learner_rss_mb_start
            else None,
        }


def soak(
    *,
    minutes: float = 10.0,
    kill_every: float = 30.0,
    down: float = 2.0,
    num_servers: int = 4,
    control: int = 1,
    envs_per_server: int = 4,
    timeout: float = 5.0,
    warmup: float = 30.0,
    log_path: str | None = None,
) -> SoakResult:
    """Run the soak (see the module's docstring) and return its figures."""
    from learner.remote import RemoteVectorEnv

    if not 0 <= control < num_servers:
        raise ValueError(f"control: expected 0 <= control < num_servers ({num_servers}), got {control}")
    k = envs_per_server
    log = open(log_path or os.devnull, "a")  # noqa: SIM115 (closed below)
    servers = [Server(k, log) for _ in range(num_servers)]
    victims = servers[control:]
    result = SoakResult(servers=num_servers, envs=num_servers * k)
    restarting: list[threading.Thread] = []
    # A hang anywhere (a step that never returns) dumps every thread's stack and ends the process.
    hang_limit = max(60.0, 4 * timeout)
    try:
        envs = RemoteVectorEnv([s.address for s in servers], fault_tolerant=True, timeout=timeout)
        n = envs.num_envs
        owner = np.repeat(np.arange(num_servers), k)
        local = np.tile(np.arange(k), num_servers)
        obs, _ = envs.reset(seed=0)
        tokens = obs[::k, 0].copy()  # per server: the token of the process its envs come from
        prev_obs = obs.copy()
        ended = np.zeros(n, dtype=bool)
        killed_at: dict[int, float] = {}  # server -> when it was killed (until its envs rejoin)
        restarted: dict[int, Server] = {}
        start = time.monotonic()
        next_kill = start + kill_every
        victim = 0
        rng = np.random.default_rng(0)
        warm = False
        step = 0
        while (now := time.monotonic()) - start < minutes * 60:
            if not warm and now - start >= warmup:
                warm = True
                result.control_rss_mb_start = [rss_mb(s.pid) for s in servers[:control]]
                result.learner_rss_mb_start = rss_mb(os.getpid())
            if victims and now >= next_kill:
                next_kill += kill_every
                i = servers.index(victims[victim % len(victims)])
                victim += 1
                if i not in killed_at:  # still down from last time: skip
                    servers[i].kill()
                    killed_at[i] = now
                    result.kills += 1
                    thread = threading.Thread(target=_restart_later, args=(servers[i], down), daemon=True)
                    thread.start()
                    restarting.append(thread)
                    restarted[i] = servers[i]
            if step % 100 == 0:
                faulthandler.dump_traceback_later(hang_limit, exit=True)
            actions = rng.integers(0, ACTIONS, size=n)
            t0 = time.perf_counter()
            obs, rewards, terms, truncs, infos = envs.step(actions)
            result.slowest_step_s = max(result.slowest_step_s, time.perf_counter() - t0)
            step += 1
            lost = np.asarray(infos.get("_env_unavailable", np.zeros(n, dtype=bool)))
            errors = _check(obs, rewards, actions, lost, prev_obs, ended, tokens, owner, local)
            # Rejoined: an unavailable env whose observation comes from a new process.
            for i in list(killed_at):
                sl = slice(i * k, (i + 1) * k)
                if lost[sl].all() and (obs[sl, 0] != tokens[i]).all():
                    if (obs[sl, 2] != 0).any() or (obs[sl, 3] != -1).any():
                        errors.append(f"server {i} rejoined without new episodes: {obs[sl].tolist()}")
                    tokens[i] = obs[sl.start, 0]
                    result.rejoin_s.append(time.monotonic() - restarted[i].ready_at)
                    del killed_at[i]
            result.errors += len(errors)
            result.error_examples += errors[: max(0, 10 - len(result.error_examples))]
            result.env_steps_checked += int((~lost).sum())
            result.env_steps_unavailable += int(lost.sum())
            prev_obs = obs.copy()
            ended = np.where(lost, False, terms | truncs)
            result.steps += 1
        faulthandler.cancel_dump_traceback_later()
        result.seconds = time.monotonic() - start
        result.steps_per_s = result.steps / result.seconds
        result.never_rejoined = len(killed_at)
        result.control_rss_mb_end = [rss_mb(s.pid) for s in servers[:control]]
        result.learner_rss_mb_end = rss_mb(os.getpid())
        stats = envs.fault_stats()
        result.failures, result.reconnects, result.server_restarts = (
            stats.failures,
            stats.reconnects,
            stats.server_restarts,
        )
        envs.close()
    finally:
        for thread in restarting:
            thread.join(timeout=30)
        for server in servers:
            if server.proc is not None and server.proc.poll() is None:
                server.kill()
        log.close()
    return result


def _restart_later(server: Server, delay: float) -> None:
    time.sleep(delay)
    server.start()


def _check(
    obs: np.ndarray,
    rewards: np.ndarray,
    actions: np.ndarray,
    lost: np.ndarray,
    prev_obs: np.ndarray,
    ended: np.ndarray,
    tokens: np.ndarray,
    owner: np.ndarray,
    local: np.ndarray,
) -> list[str]:
    """What is wrong with one step's results (empty when all is well)."""
    errors = []
    ok = ~lost
    token, index, t, last = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
    for j in np.flatnonzero(ok & ((index != local) | (token != tokens[owner]))):
        errors.append(f"env {j}: result of env {int(index[j])} of process {token[j]:.0f}, expected env {local[j]}")
    stepped = ok & ~ended
    for j in np.flatnonzero(stepped & ((t != prev_obs[:, 2] + 1) | (last != actions))):
        errors.append(
            f"env {j}: t {t[j]:.0f} last_action {last[j]:.0f}, expected t {prev_obs[j, 2] + 1:.0f} action {actions[j]}"
        )
    reset = ok & ended  # next-step autoreset: the step after an episode's end resets it
    for j in np.flatnonzero(reset & ((t != 0) | (last != -1))):
        errors.append(f"env {j}: expected a reset step after its episode ended, got t {t[j]:.0f}")
    # Unavailable envs: their last observation and reward 0, unless they are rejoining (checked by the caller).
    stale = lost & (token == prev_obs[:, 0])
    for j in np.flatnonzero(stale & ((obs != prev_obs).any(axis=1) | (rewards != 0))):
        errors.append(f"env {j}: unavailable but its observation or reward changed: {obs[j].tolist()}")
    return errors


def main(argv: Sequence[str] | None = None) -> int:
    from env_server.tuning import prefer_fast_grpc_core

    prefer_fast_grpc_core()
    parser = argparse.ArgumentParser(
        prog="python -m learner.benchmarks.soak",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--minutes", type=number(0, above=True), default=10.0, metavar="MIN", help="minutes to run (default: 10)"
    )
    parser.add_argument(
        "--kill-every",
        type=number(0, above=True),
        default=30.0,
        metavar="S",
        help="seconds between two kills (default: 30)",
    )
    parser.add_argument(
        "--down", type=number(0), default=2.0, metavar="S", help="seconds a killed server stays down (default: 2)"
    )
    parser.add_argument(
        "--servers", type=number(1, integer=True), default=4, metavar="N", help="env servers (default: 4)"
    )
    parser.add_argument(
        "--control",
        type=number(0, integer=True),
        default=1,
        metavar="N",
        help="servers never killed (their memory is watched); fewer than --servers (default: 1)",
    )
    parser.add_argument(
        "--envs-per-server",
        type=number(1, integer=True),
        default=4,
        metavar="N",
        help="IndexEnv envs per server (default: 4)",
    )
    parser.add_argument(
        "--timeout",
        type=number(0, above=True),
        default=5.0,
        metavar="S",
        help="RemoteVectorEnv's timeout, seconds per call (default: 5)",
    )
    parser.add_argument(
        "--warmup",
        type=number(0),
        default=30.0,
        metavar="S",
        help="seconds before the first memory reading (default: 30)",
    )
    parser.add_argument("--out", default=None, metavar="PATH", help="also write the figures, as JSON, to this file")
    parser.add_argument("--server-log", default=None, metavar="PATH", help="append the servers' logs to this file")
    args = parser.parse_args(argv)
    if args.control >= args.servers:
        parser.error(f"--control: expected fewer than --servers ({args.servers}), got {args.control}")
    result = soak(
        minutes=args.minutes,
        kill_every=args.kill_every,
        down=args.down,
        num_servers=args.servers,
        control=args.control,
        envs_per_server=args.envs_per_server,
        timeout=args.timeout,
        warmup=args.warmup,
        log_path=args.server_log,
    )
    summary = result.summary()
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    ok = result.errors == 0 and result.never_rejoined == 0 and summary["rejoin_s_max"] <= 10
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
