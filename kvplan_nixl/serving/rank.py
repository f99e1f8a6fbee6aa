"""What one worker rank of a connector offers the parts that move its requests
(:mod:`.pulls`, :mod:`.push_io`, :mod:`.restarts`): :class:`Rank`, the attributes they read
and the one method they call, as a typing protocol; and what they count (:class:`Stats`).

An engine's worker (vLLM's: ``kvplan_nixl.vllm.worker.Worker``) has them; the parts name this
protocol instead of the worker, so the worker imports its parts and no part imports the worker
(or its engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvplan_nixl.serving.locks import FairLock

if TYPE_CHECKING:
    from kvplan.adapters.vllm import TransferGroups
    from kvplan_nixl.digest import Digester
    from kvplan_nixl.serving.control import Control, Sends
    from kvplan_nixl.serving.handshakes import Handshakes
    from kvplan_nixl.serving.loads import Load
    from kvplan_nixl.serving.settings import Settings


class Stats(Protocol):
    """The counts the parts keep (an engine's stats object: vLLM's ``KvplanStats``)."""

    def record(self, key: str, n: int = 1) -> None:
        """Count ``n`` events of ``key`` (``num_failed_transfers``, ...)."""
        ...

    def record_transfer(self, seconds: float, post_seconds: float, nbytes: int, runs: int,
                        descriptors: int) -> None:
        """One transfer done: its time, its post's, its bytes, runs and descriptors."""
        ...


class Rank(Protocol):
    """One TP rank's state that its pulls and pushes share (under ``lock``)."""

    c: Settings
    rank: int
    lock: FairLock  # held for every Endpoint call (first come, first served)
    ep: Any  # kvplan_nixl.Endpoint
    groups: TransferGroups
    whole: bool  # the backend moves whole pages only
    timeout: float  # transfer_timeout_s
    hs_timeout: float  # handshake_timeout_s
    secret: str | None  # the deployment secret (signs metadata and control messages)
    # the engine's check of a peer's advertised versions at handshake (PeerInfo -> raises)
    check_peer: Callable[[Any], None]
    lease: float  # lease_s
    heartbeat: float  # heartbeat_s
    lease_pin: float  # lease_pin_s: the pin a LEASE asks (0: no LEASE, CONFIRM before report)
    lease_margin: float  # lease_margin_s: a leased read must be seen complete this much early
    nixl_heartbeat: float  # a NixlConnector prefill's: kv_lease_duration / 6
    stats: Stats
    digester: Digester | None  # the transfer digest's, None when it is off
    sends: Sends | None
    ctl: Control
    hs: Handshakes | None
    nixl: Any  # NixlPrefills (kvplan_nixl.vllm.nixl_peer): NixlConnector prefills' handshakes
    cuda: bool  # the KV caches are CUDA tensors
    engines: dict[str, tuple[Any, list[int]]]  # prefill engine -> pull map, readers per rank
    recv_done: set[str]  # decode requests whose KV is loaded (or failed), to report
    admitted: dict[str, float]  # decode loads -> when the worker got them (monotonic)
    reporting: dict[str, tuple[float, ...]]  # loaded pulls to report -> their timeline marks
    waiting: dict[str, tuple[Load, float]]  # decode loads whose handshake is pending
    writes: Any  # Writes (kvplan_nixl.serving.push_io): pushes to write, their handshakes
    restarts: Any  # Restarts (kvplan_nixl.serving.restarts): prefills connected afresh

    def fail(self, load: Load, why: str, peers: tuple[int, ...] = ()) -> None:
        """``load`` failed: end its holds, hand its blocks to vLLM's failure policy."""
        ...
