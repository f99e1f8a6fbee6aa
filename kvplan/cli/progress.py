"""Progress for steps that may take more than a second: a spinner with elapsed time on stderr.

``with step("importing NIXL"):`` shows ``⠋ importing NIXL 0:00:01`` on a terminal's stderr
while the block runs and erases it when the block ends, so stdout (tables, JSON) stays clean
and a pipe or a log file never sees escape codes. Environment ``KVPLAN_PROGRESS=1`` forces
the display (a CI log that wants to see the steps), ``KVPLAN_PROGRESS=0`` turns it off. Uses
``rich`` (the ``cli`` extra); without it a terminal gets one plain line per step.

A step made of parts (``with step("counting") as update: ... update("part 2 of 7")``) changes
the spinner's text. Without a terminal nothing is printed at all (unless ``KVPLAN_PROGRESS=1``):
progress lines in a log file start midway and mean nothing there.

Layer: the CLI (top of the core); imports only rich (optional).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["enabled", "step"]


def enabled() -> bool:
    """Whether :func:`step` shows anything: ``KVPLAN_PROGRESS`` if set, else stderr is a tty."""
    forced = os.environ.get("KVPLAN_PROGRESS")
    if forced is not None:
        return forced not in ("", "0", "no", "false")
    return sys.stderr.isatty()


@contextmanager
def step(text: str) -> Iterator[Callable[[str], None]]:
    """Show ``text`` with a spinner and the elapsed time on stderr while the block runs (only
    where :func:`enabled`). Yields ``update(part)``, which shows ``text: part`` instead."""
    start = time.monotonic()
    shown = [text]
    if not enabled():  # a pipe or a log file: nothing, not lines starting midway
        yield lambda part: None
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
