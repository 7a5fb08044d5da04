"""Training across network hosts against the same layout on loopback, side by side.

    sudo python -m tests.measure_netns [--hosts 4] [--envs-per-server 4] [--timesteps 20480] [--rounds 3]

Two layouts of the same fleet, in one lab (tests/netns.py): N env servers on N hosts of their own,
each reached over its veth link and the switch ("netns"), and N env servers on the learner host's
loopback ("loopback"). The same `learner train` (same seed, so the same trajectories and updates)
runs against each in turn, the order alternating round by round so that the machine's noise falls on
both alike. Reported per layout, medians over rounds: training SPS (env steps over the whole run),
rollout SPS (env steps over the time spent stepping envs, updates left out: the part the network
can slow down), and the bytes each host's link carried per step of its server. Then, finer: one
process on the learner host opens both fleets and steps them in turns of --burst seconds (random
actions, no policy), so each pair of turns sees the same machine; reported is the median of the
per-pair ratios. The target (issue 7): netns within 10 % of loopback. Last, one host's link is cut
for --cut seconds under a fleet stepping in one process, once with a step deadline shorter than the
cut (2 s: the host is lost, the others step on) and once with the default (30 s: stepping waits);
reported: the longest step, failures and reconnects counted, and when the host's envs were all
available again after the link came back (the target: within 10 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from learner import rundir
from tests.netns import Lab, netns_problem


def train_once(lab: Lab, addresses: list[str], timesteps: int, run_dir: Path) -> dict[str, float]:
    """One training run from the learner host; its SPS figures."""
    command = [sys.executable, "-m", "learner", "train", "--servers", ",".join(addresses), "--seed", "1"]
    command += ["--total-timesteps", str(timesteps), "--num-steps", "32", "--checkpoint-every", "0"]
    command += ["--no-tensorboard", "--no-plot", "--no-progress", "--run-dir", str(run_dir)]
    result = lab.run("learner", command, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"learner train failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    rows = rundir.read_jsonl(run_dir / rundir.METRICS)
    steps = sum(r["num_envs"] * 32 for r in rows)
    return {
        "training_sps": summary["total_steps"] / summary["seconds"],
        "rollout_sps": steps / sum(r["rollout_seconds"] for r in rows),
    }


def alternate_stepping(netns: list[str], loopback: list[str], pairs: int, burst: float) -> list[float]:
    """In this process: both fleets open, stepped in turns of ``burst`` s; netns/loopback SPS per pair."""
    import numpy as np

    from learner import RemoteVectorEnv

    with RemoteVectorEnv(netns, copy=False) as a, RemoteVectorEnv(loopback, copy=False) as b:
        actions = np.zeros(a.num_envs, dtype=np.int64)
        for envs in (a, b):
            envs.reset(seed=0)
            for _ in range(50):
                envs.step(actions)

        def sps(envs: RemoteVectorEnv) -> float:
            steps, start = 0, time.perf_counter()
            while time.perf_counter() - start < burst:
                envs.step(actions)
                steps += 1
            return steps * envs.num_envs / (time.perf_counter() - start)

        ratios = []
        for pair in range(pairs):
            first, second = (a, b) if pair % 2 == 0 else (b, a)
            x, y = sps(first), sps(second)
            ratios.append(x / y if first is a else y / x)
    return ratios


def cut_probe(addresses: list[str], host_envs: tuple[int, int], seconds: float, timeout: float) -> dict[str, Any]:
    """In this process: a fault-tolerant fleet stepped for ``seconds``, while the measurement cuts a
    host's link; per step, when it ended (CLOCK_MONOTONIC, shared by every namespace) and how many of
    the cut host's envs (``host_envs``, a range) were unavailable."""
    import numpy as np

    from learner import RemoteVectorEnv

    times, down, longest = [], [], 0.0
    with RemoteVectorEnv(addresses, copy=False, fault_tolerant=True, timeout=timeout) as envs:
        actions = np.zeros(envs.num_envs, dtype=np.int64)
        envs.reset(seed=0)
        print("ready", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            _, _, _, _, infos = envs.step(actions)
            now = time.monotonic()
            longest = max(longest, now - start)
            mask = infos.get("env_unavailable")
            times.append(now)
            down.append(int(np.sum(mask[host_envs[0] : host_envs[1]])) if mask is not None else 0)
        stats = envs.fault_stats()
    return {
        "times": times,
        "down": down,
        "longest_step_s": longest,
        "failures": stats.failures,
        "reconnects": stats.reconnects,
    }


def measure_cut(
    lab: Lab, hosts: list[str], addresses: list[str], envs_per_server: int, cut: float, timeout: float
) -> dict[str, Any]:
    """Cut the second host's link for ``cut`` s under a stepping fleet (step deadline ``timeout``), restore
    it; how long stepping stalled, and how long after the restore its envs were all available again."""
    host = 1
    probe = [sys.executable, "-m", "tests.measure_netns", "--cut-probe", ",".join(addresses)]
    probe += ["--cut-envs", f"{host * envs_per_server},{(host + 1) * envs_per_server}"]
    probe += ["--cut-seconds", str(cut + 25), "--cut-timeout", str(timeout)]
    proc = lab.popen("learner", probe, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"cut probe failed: {proc.communicate()[1][-2000:]}")
    time.sleep(3)
    cut_at = time.monotonic()
    lab.cut(hosts[host])
    time.sleep(cut)
    lab.restore(hosts[host])
    restored_at = time.monotonic()
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"cut probe failed:\n{err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    steps = list(zip(result["times"], result["down"], strict=True))
    # The host's envs are back at the first step after which none of them is unavailable again.
    back = next((t for i, (t, _) in enumerate(steps) if t > restored_at and all(d == 0 for _, d in steps[i:])), None)
    return {
        "cut_s": cut,
        "step_timeout_s": timeout,
        "longest_step_s": result["longest_step_s"],
        "first_unavailable_after_cut_s": next((t - cut_at for t, d in steps if d > 0), None),
        "rejoined_after_restore_s": None if back is None else back - restored_at,
        "failures": result["failures"],
        "reconnects": result["reconnects"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4, help="env-server hosts (default: 4)")
    parser.add_argument("--envs-per-server", type=int, default=4, help="CartPole envs per server (default: 4)")
    parser.add_argument("--timesteps", type=int, default=20480, help="env steps per training run (default: 20480)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout (default: 3)")
    parser.add_argument(
        "--pairs", type=int, default=40, help="turns of each fleet when stepping side by side (default: 40)"
    )
    parser.add_argument("--burst", type=float, default=0.5, help="seconds per turn (default: 0.5)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--cut", type=float, default=5.0, help="seconds a host's link is cut (default: 5)")
    parser.add_argument("--side-by-side", nargs=2, metavar=("NETNS", "LOOPBACK"), help=argparse.SUPPRESS)
    parser.add_argument("--cut-probe", metavar="ADDRESSES", help=argparse.SUPPRESS)
    parser.add_argument("--cut-envs", metavar="START,STOP", help=argparse.SUPPRESS)
    parser.add_argument("--cut-seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--cut-timeout", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cut_probe:  # run inside the learner host by measure_cut
        start, stop = (int(x) for x in args.cut_envs.split(","))
        print(json.dumps(cut_probe(args.cut_probe.split(","), (start, stop), args.cut_seconds, args.cut_timeout)))
        return 0
    if args.side_by_side:  # run inside the learner host by the measurement below
        netns, loopback = (a.split(",") for a in args.side_by_side)
        print(json.dumps(alternate_stepping(netns, loopback, args.pairs, args.burst)))
        return 0
    problem = netns_problem()
    if problem:
        print(f"cannot measure: {problem}", file=sys.stderr)
        return 1
    hosts = [f"h{i}" for i in range(args.hosts)]
    samples: dict[str, list[dict[str, float]]] = {"netns": [], "loopback": []}
    link_bytes_per_step: list[float] = []
    with Lab(["learner", *hosts]) as lab, tempfile.TemporaryDirectory() as tmp:
        remote = [s.address for s in lab.start_servers(hosts, "CartPole-v1", args.envs_per_server)]
        local = [
            s.address
            for s in lab.start_servers(["learner"] * args.hosts, "CartPole-v1", args.envs_per_server, loopback=True)
        ]
        for r in range(args.rounds):
            order = ["netns", "loopback"] if r % 2 == 0 else ["loopback", "netns"]
            for layout in order:
                before = [sum(lab.link_bytes(h)) for h in hosts]
                run_dir = Path(tmp) / f"{layout}-{r}"
                samples[layout].append(train_once(lab, remote if layout == "netns" else local, args.timesteps, run_dir))
                if layout == "netns":
                    carried = [sum(lab.link_bytes(h)) - b for h, b in zip(hosts, before, strict=True)]
                    server_steps = args.timesteps / (args.hosts * args.envs_per_server)
                    link_bytes_per_step.append(statistics.median(carried) / server_steps)
                print(
                    f"round {r + 1} {layout:<8} " + "  ".join(f"{k} {v:,.0f}" for k, v in samples[layout][-1].items()),
                    flush=True,
                )
        probe = [sys.executable, "-m", "tests.measure_netns", "--pairs", str(args.pairs), "--burst", str(args.burst)]
        probe += ["--side-by-side", ",".join(remote), ",".join(local)]
        result = lab.run("learner", probe, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"side-by-side stepping failed:\n{result.stderr[-2000:]}")
        pair_ratios = json.loads(result.stdout.strip().splitlines()[-1])
        cuts = [measure_cut(lab, hosts, remote, args.envs_per_server, args.cut, t) for t in (2.0, 30.0)]

    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "side_by_side")}}
    for layout, runs in samples.items():
        results[layout] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    results["ratio"] = {key: results["netns"][key] / results["loopback"][key] for key in results["netns"]}
    results["link_bytes_per_server_step"] = statistics.median(link_bytes_per_step)
    results["side_by_side_ratio"] = {"median": statistics.median(pair_ratios), "pairs": pair_ratios}
    results["cuts"] = cuts
    print()
    print(
        f"{args.hosts} servers x {args.envs_per_server} CartPole-v1 envs, {args.timesteps:,} env steps per run, medians of {args.rounds}"
    )
    print(f"{'':<36} {'netns hosts':>12} {'loopback':>12} {'ratio':>8}")
    for key, label in (("training_sps", "training SPS"), ("rollout_sps", "rollout SPS (env stepping only)")):
        print(
            f"{label:<36} {results['netns'][key]:>12,.0f} {results['loopback'][key]:>12,.0f} {results['ratio'][key]:>8.3f}"
        )
    ratios = sorted(pair_ratios)
    print(
        f"stepping side by side in one process, {args.pairs} turns of {args.burst:g} s each: netns/loopback SPS "
        f"median {results['side_by_side_ratio']['median']:.3f} "
        f"(quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})"
    )
    print(
        f"bytes on each host's link per step of its server (both ways, all headers): {results['link_bytes_per_server_step']:,.0f}"
    )
    for c in cuts:
        rejoined = c["rejoined_after_restore_s"]
        print(
            f"host h1 cut for {c['cut_s']:g} s, step deadline {c['step_timeout_s']:g} s: longest step "
            f"{c['longest_step_s']:.1f} s, failures {c['failures']}, reconnects {c['reconnects']}, its envs all "
            + ("never back" if rejoined is None else f"back {rejoined:.1f} s after the link was")
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
