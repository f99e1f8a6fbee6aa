"""Progress for steps that may take more than a second: a spinner with elapsed time on stderr.

``with step("importing NIXL"):`` shows ``⠋ importing NIXL 0:00:01`` on a terminal's stderr
while the block runs and erases it when the block ends, so stdout (tables, JSON) stays clean
and a pipe or a log file never sees escape codes. Environment ``KVPLAN_PROGRESS=1`` forces
the display (a CI log that wants to see the steps), ``KVPLAN_PROGRESS=0`` turns it off. Uses
``rich`` (the ``cli`` extra); without it a terminal gets one plain line per step.

A step made of parts (``with step("counting", log=True) as update: ... update("part 2 of 7")``)
changes the spinner's text on a terminal; on a pipe or a log file, where no spinner is drawn,
``log=True`` prints each part as one plain line on stderr once the step has run for
:data:`LOG_AFTER` seconds, so a long run is never silent and a short one stays quiet (not in a
Jupyter cell, whose saved output would keep them).

Layer: the CLI (top of the core); imports only rich (optional).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["LOG_AFTER", "enabled", "step"]

#: Seconds after which a ``log=True`` step prints its parts as lines when stderr is no terminal.
LOG_AFTER = 1.0


def enabled() -> bool:
    """Whether :func:`step` shows anything: ``KVPLAN_PROGRESS`` if set, else stderr is a tty."""
    forced = os.environ.get("KVPLAN_PROGRESS")
    if forced is not None:
        return forced not in ("", "0", "no", "false")
    return sys.stderr.isatty()


def _notebook() -> bool:
    """Whether stderr is a Jupyter cell's output (lines there would stay in the notebook)."""
    return type(sys.stderr).__module__.startswith("ipykernel")


@contextmanager
def step(text: str, *, log: bool = False) -> Iterator[Callable[[str], None]]:
    """Show ``text`` with a spinner and the elapsed time on stderr while the block runs.

    Yields ``update(part)``, which shows ``text: part`` instead; with ``log=True`` and no
    spinner (stderr not a terminal, ``KVPLAN_PROGRESS`` unset), each update after
    :data:`LOG_AFTER` seconds prints as a line ``text: part (12.3 s)``.
    """
    start = time.monotonic()
    shown = [text]

    def log_line(part: str) -> None:
        if time.monotonic() - start >= LOG_AFTER and not _notebook():
            print(f"{text}: {part} ({time.monotonic() - start:.1f} s)", file=sys.stderr,
                  flush=True)

    if not enabled():
        quiet = os.environ.get("KVPLAN_PROGRESS") is not None  # set, and off
        yield log_line if log and not quiet else (lambda part: None)
        return
    try:
        from rich.console import Console
        from rich.spinner import Spinner
        from rich.table import Table
    except ImportError:
        print(f"{text} ...", file=sys.stderr, flush=True)
        yield lambda part: print(f"{text}: {part}", file=sys.stderr, flush=True)
        return
    from rich.live import Live

    def update(part: str) -> None:
        shown[0] = f"{text}: {part}"

    class _Line:  # re-rendered by Live a few times a second
        def __rich__(self):
            grid = Table.grid(padding=(0, 1))
            grid.add_row(Spinner("dots"), shown[0], f"{time.monotonic() - start:.1f} s")
            return grid

    forced = os.environ.get("KVPLAN_PROGRESS") is not None  # enabled() said yes: draw anyway
    console = Console(stderr=True, force_terminal=True if forced else None)
    with Live(_Line(), console=console, transient=True, refresh_per_second=8):
        yield update
