"""Benchmarks, measured side by side in one run on one machine (never pass/fail tests: machines are noisy).

``learner bench`` (remote envs against local vector envs): ``throughput`` (env-steps/s of vector envs,
interleaved rounds), ``suites`` (the workloads), ``rpc`` (the cost of one round trip), ``ppo``
(``learner train`` SPS per layout), ``report`` (targets, Markdown, PNG) and ``run`` (all of it, as
``learner bench`` runs it).

Modules run on their own (``python -m learner.benchmarks.<name>``): ``cartpole_solve`` (time to solve
CartPole-v1 against stable-baselines3, and 8 remote envs against 1), ``gpu_check`` (the learner on
CUDA: to solved, and throughput with 16 local servers), ``capacity`` (CPU and network per replica-step),
``soak`` (servers killed under a stepping learner, every result checked) and ``wake`` (a step's own code
after a wait); ``report`` writes bench.md and bench.png again from a bench.json (after a change to the
report).
"""
