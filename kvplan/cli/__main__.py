"""``python -m kvplan.cli``: the ``kvplan`` command (layer: the CLI, top of the core)."""

import sys

from kvplan.cli.command import main

sys.exit(main())
