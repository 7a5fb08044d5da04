"""``python -m learner``: the same as the ``learner`` command."""

import sys

from learner.cli import main

sys.exit(main())
