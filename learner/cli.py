"""The ``learner`` command (also ``python -m learner``): demo, and more as the project grows."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import gymnasium as gym
import numpy as np

from learner.local import LocalServers
from learner.remote import RemoteVectorEnv

__all__ = ["main"]


def _measure(envs: gym.vector.VectorEnv, steps: int, seed: int) -> tuple[float, int]:
    """Env-steps per second of random actions, and how many episodes ended."""
    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    actions = [envs.action_space.sample() for _ in range(64)]
    envs.step(actions[0])  # warm-up
    episodes = 0
    start = time.perf_counter()
    for t in range(steps):
        _, _, terminations, truncations, _ = envs.step(actions[t % len(actions)])
        episodes += int(np.sum(terminations | truncations))
    elapsed = time.perf_counter() - start
    return steps * envs.num_envs / elapsed, episodes


def cmd_demo(args: argparse.Namespace) -> int:
    """Start local env servers, step a RemoteVectorEnv over them, and compare with AsyncVectorEnv."""
    total = args.num_servers * args.envs_per_server
    print(
        f"envfleet demo: {args.env}, {args.num_servers} local servers x {args.envs_per_server} envs, {args.steps} steps"
    )
    # gymnasium's AsyncVectorEnv first: it forks, which must happen before this process opens gRPC channels.
    reference = gym.vector.AsyncVectorEnv([lambda: gym.make(args.env)] * total)
    ref_sps, _ = _measure(reference, args.steps, args.seed)
    reference.close()
    with LocalServers(args.env, args.num_servers, args.envs_per_server, transport=args.transport) as servers:
        print(f"servers: {', '.join(servers.addresses)}")
        with RemoteVectorEnv(servers.addresses) as envs:
            sps, episodes = _measure(envs, args.steps, args.seed)
    print(f"{'vector env':<40} {'env-steps/s':>12}")
    print(f"{f'RemoteVectorEnv ({args.num_servers} x {args.envs_per_server})':<40} {sps:>12,.0f}")
    print(f"{f'gymnasium AsyncVectorEnv ({total})':<40} {ref_sps:>12,.0f}")
    print(f"ratio remote / async: {sps / ref_sps:.2f}; {episodes} episodes ended on the remote envs")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="learner", description="envfleet's learner: drive a fleet of env servers.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="step random actions on local env servers and compare with AsyncVectorEnv")
    demo.add_argument("--env", default="CartPole-v1", help="gymnasium id or entry point (default: %(default)s)")
    demo.add_argument("--num-servers", type=int, default=2, help="local env servers to start (default: %(default)s)")
    demo.add_argument("--envs-per-server", type=int, default=4, help="envs per server (default: %(default)s)")
    demo.add_argument("--steps", type=int, default=3000, help="vector steps to time (default: %(default)s)")
    demo.add_argument(
        "--transport", choices=["tcp", "unix"], default="tcp", help="how to reach local servers (default: %(default)s)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
