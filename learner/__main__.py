"""``python -m learner``: the same as the ``learner`` command."""

from learner.cli import run

run()
