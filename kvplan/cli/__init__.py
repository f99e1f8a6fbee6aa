"""The ``kvplan`` command line: plan and print without NIXL; other packages add commands.

Layer 7: the top of the core. These modules may import every ``kvplan`` module (and rich, when
installed) but nothing from nixl, torch or the executor's package: the commands that move bytes
(``demo``) come from the packages that provide them, through the entry-point group
``kvplan.commands`` (:func:`kvplan.cli.command._plugins`).

- :mod:`kvplan.cli.command`: the parser, ``plan``, :func:`main`, the entry-point commands.
- :mod:`kvplan.cli.explain`: ``explain``, ``check``, ``spec`` and ``presets``.
- :mod:`kvplan.cli.cliargs`: bounded argument types, the help format, one-line usage errors.
- :mod:`kvplan.cli.progress`: the spinner on a terminal's stderr (rich, optional).

``python -m kvplan.cli ...`` is the same as the ``kvplan`` console script.
"""

from kvplan.cli.command import main

__all__ = ["main"]
