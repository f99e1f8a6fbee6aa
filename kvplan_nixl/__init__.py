"""kvplan_nixl: execute kvplan plans over NIXL, pull or push, with failures named and handled.

The whole public API::

    ep = Endpoint("decode", spec, rank, buffers)        # agent + registered regions
    ep.connect(peer_metadata, mode="pull")              # per peer rank: layout check + lists
    plan = ep.map("prefill").plan(src_blocks, dst_blocks)
    t = ep.read(plan, "prefill", notify=b"req-7")       # or ep.write(plan, "decode") to push
    t.wait(timeout=5.0)                                 # TransferFailed / TransferTimeout
    st = Stager(ep, pool_bytes=64 << 20)                # staged transfers (bounce buffers):
    st.post(plan, "prefill", how="auto").wait()         #   Stager made before metadata()
    ep.close()

nixl is imported on first use of ``Endpoint``, ``Transfer`` or ``State`` (PEP 562), so the
errors, ``kvplan_nixl.descriptors``, ``kvplan_nixl.metadata`` and ``kvplan plan`` work without it.

The package owns only this list of public names and where each lives: the direct executor's
facade is ``endpoint.Endpoint``, the staged executor's ``staged.Stager`` (docs/executor.md,
"Modules", draws the rooms behind them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvplan_nixl.errors import (
    ArgumentError,
    BoundsError,
    BufferSizeError,
    BusyError,
    ClosedError,
    DeadlinePassed,
    DigestMismatch,
    ExecutorError,
    MetadataError,
    NixlError,
    NotConnectedError,
    ParamsError,
    PeerTimeout,
    PlanMismatchError,
    TransferFailed,
    TransferTimeout,
)

if TYPE_CHECKING:
    from kvplan_nixl.digest import Digester
    from kvplan_nixl.endpoint import Endpoint
    from kvplan_nixl.notifications import Notification
    from kvplan_nixl.parts import RequestTransfer
    from kvplan_nixl.peers import Peer
    from kvplan_nixl.staged import MixedTransfer, StagedTransfer, Stager
    from kvplan_nixl.transfer import State, Transfer

_LAZY = {
    "Digester": "kvplan_nixl.digest",
    "Endpoint": "kvplan_nixl.endpoint",
    "Notification": "kvplan_nixl.notifications",
    "Peer": "kvplan_nixl.peers",
    "MixedTransfer": "kvplan_nixl.staged",
    "StagedTransfer": "kvplan_nixl.staged",
    "Stager": "kvplan_nixl.staged",
    "RequestTransfer": "kvplan_nixl.parts",
    "State": "kvplan_nixl.transfer",
    "Transfer": "kvplan_nixl.transfer",
}

__all__ = [
    "ArgumentError",
    "BoundsError",
    "BufferSizeError",
    "BusyError",
    "ClosedError",
    "DeadlinePassed",
    "DigestMismatch",
    "Digester",
    "Endpoint",
    "ExecutorError",
    "MetadataError",
    "MixedTransfer",
    "NixlError",
    "NotConnectedError",
    "Notification",
    "ParamsError",
    "Peer",
    "PeerTimeout",
    "PlanMismatchError",
    "RequestTransfer",
    "StagedTransfer",
    "Stager",
    "State",
    "Transfer",
    "TransferFailed",
    "TransferTimeout",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvplan_nixl' has no attribute {name!r}")
