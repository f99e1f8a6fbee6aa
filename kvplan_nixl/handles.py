"""Handles: the ledger of live NIXL objects one owner made (an Endpoint, or a Stager).

Owns the counts by kind (``xfer``, ``dlist``, ``remote_agents``, ``registrations``) and the one
way to prepare and release descriptor lists and transfer handles, so that ``handles()`` of an
Endpoint or a Stager reports what is really held. It never decides *when* to release: its owner
does. It may not import any other module of kvplan_nixl than ``errors``.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from kvplan_nixl.errors import nixl_call, release_counted

__all__ = ["Handles"]


class Handles:
    """Live NIXL objects by kind, with the calls that make and release them."""

    def __init__(self, **initial: int) -> None:
        self.live: collections.Counter[str] = collections.Counter(initial)

    def prep(self, agent: Any, name: str, rows: np.ndarray, mem: str, what: str) -> Any:
        """Prepare a descriptor list of ``rows`` on ``agent`` for agent ``name``."""
        with nixl_call("prep_xfer_dlist", what):
            h = agent.prep_xfer_dlist(name, rows, mem)
        self.live["dlist"] += 1
        return h

    def release_dlist(self, h: Any, errors: list[BaseException] | None = None) -> None:
        """Release a prepared list (None: nothing was prepared). With ``errors``, a failure is
        appended there instead of raised (close keeps releasing the rest)."""
        if h is None:
            return
        try:
            with nixl_call("release of a descriptor list"):
                h.release()
            self.live["dlist"] -= 1
        except Exception as exc:
            if errors is None:
                raise
            errors.append(exc)

    def count_xfer(self) -> None:
        """A transfer handle was made."""
        self.live["xfer"] += 1

    def release(self, h: Any, kind: str = "xfer") -> None:
        """Release a handle of ``kind`` quietly: a NIXL error leaves it counted (NIXL frees it
        with its agent), any other exception propagates."""
        release_counted(h, self.live, kind)
