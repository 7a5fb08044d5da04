"""``learner bench``: remote envs against local vector envs, measured side by side in one run.

Modules: ``throughput`` (env-steps/s of vector envs, interleaved rounds), ``suites`` (the workloads),
``rpc`` (the cost of one round trip), ``ppo`` (``learner train`` SPS per layout), ``report``
(targets, Markdown, PNG) and ``run`` (all of it, as ``learner bench`` runs it).
"""
