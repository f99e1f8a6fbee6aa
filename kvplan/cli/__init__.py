"""The ``kvplan`` command line: plan and print without NIXL, and the hook the NIXL package uses.

Layer: the top of the core. These modules may import every ``kvplan`` module (and rich, when
installed) but nothing from nixl, torch or ``kvplan_nixl``, except the one plug-in hook in
:func:`kvplan.cli.command._plugins`, which adds the commands that move bytes (``demo``) when the
NIXL package imports.

- :mod:`kvplan.cli.command`: the parser, ``plan``, :func:`main` and the plug-in hook.
- :mod:`kvplan.cli.explain`: ``explain``, ``check``, ``spec`` and ``presets``.
- :mod:`kvplan.cli.cliargs`: bounded argument types, the help format, one-line usage errors.
- :mod:`kvplan.cli.progress`: the spinner on a terminal's stderr (rich, optional).

``python -m kvplan.cli ...`` is the same as the ``kvplan`` console script.
"""

from kvplan.cli.command import main

__all__ = ["main"]
